// Interface between the FP8 cast frontend (fp8_ops.cpp, fp8_cuda_ops.cpp) and the
// kernels (fp8_cpu.cpp, fp8_cuda.cu). No torch headers here so the kernels compile
// quickly and the .cu compiles with plain nvcc.
#pragma once

#include <cstdint>

namespace engine {
namespace fp8 {

enum InType : int { kInF32 = 0, kInBF16 = 1, kInF16 = 2 };

// x is viewed as a row-major (rows, cols) matrix: cols = x.size(-1).
struct CastArgs {
  const void* x;
  int in_type;     // InType
  int format;      // Format (fp8_convert.h): 0 = e4m3fn, 1 = e5m2
  uint8_t* out;    // (rows, cols)
  uint8_t* out_t;  // (cols, rows) or nullptr
  int64_t rows;
  int64_t cols;
  float scale;     // CPU only; the CUDA kernel reads the scale from device memory
};

// CPU, no transpose: elements [begin, end) of the flat array. Returns the bits of
// max |x| over the range (as uint32: for |x| the integer order is the float order and
// NaN bits exceed inf's, so the max propagates NaN like torch's max does).
uint32_t cast_flat_cpu(const CastArgs& a, int64_t begin, int64_t end);
// CPU, with transpose: rows [row_begin, row_end), writing out and out_t.
uint32_t cast_rows_transpose_cpu(const CastArgs& a, int64_t row_begin, int64_t row_end);
// Which code path the CPU dispatch picked: "avx512", "avx2" or "baseline".
const char* cpu_isa();
// Test hook: force the best variant not above `name` (avx512 > avx2 > baseline).
const char* set_cpu_isa(const char* name);

#ifdef ENGINE_WITH_CUDA
// One launch over the whole tensor; amax (one float, device) is zeroed and reduced
// into by the launch. `stream` is a cudaStream_t.
void cast_cuda(const CastArgs& a, const float* scale, float* amax, void* stream);
#endif

}  // namespace fp8
}  // namespace engine
