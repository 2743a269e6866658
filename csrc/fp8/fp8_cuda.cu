// FP8 cast on CUDA: scale, saturate, round (fp8_convert.h, the same code as the CPU
// kernel), amax of the input, and optionally the transposed output, in one pass.
//
// * no transpose: grid-stride loop, 4 elements per thread per step (16-byte fp32 loads,
//   4-byte FP8 stores);
// * transpose: 64x64 tiles; the block reads its tile once (coalesced along columns),
//   writes `out` rows and stages the bytes in shared memory, then writes `out_t` rows
//   (coalesced along the original rows), 4 bytes per store.
// amax: per-thread max of |x| bits -> warp -> block -> one atomicMax on the float's bits
// (for |x| the unsigned order is the float order and NaN's bits exceed inf's).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "fp8_convert.h"
#include "fp8_kernel.h"

namespace engine {
namespace fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;

template <int IN>
__device__ __forceinline__ float load_elem(const void* p, int64_t i) {
  if constexpr (IN == kInF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (IN == kInBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// 4 consecutive elements starting at i (i % 4 == 0, base suitably aligned).
template <int IN>
__device__ __forceinline__ void load4(const void* p, int64_t i, float (&v)[4]) {
  if constexpr (IN == kInF32) {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
    const uint16_t h[4] = {static_cast<uint16_t>(raw.x & 0xFFFF), static_cast<uint16_t>(raw.x >> 16),
                           static_cast<uint16_t>(raw.y & 0xFFFF), static_cast<uint16_t>(raw.y >> 16)};
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = IN == kInBF16 ? bf16_to_float(h[e]) : fp16_to_float(h[e]);
  }
}

__device__ __forceinline__ uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

__device__ __forceinline__ void reduce_amax(uint32_t m, float* amax) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  __shared__ uint32_t warp_max[32];
  const int nthreads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  if (tid % 32 == 0) warp_max[tid / 32] = m;
  __syncthreads();
  if (tid == 0) {
    uint32_t b = 0;
    for (int w = 0; w < (nthreads + 31) / 32; ++w) b = max(b, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax), b);
  }
}

template <int IN, int F>
__global__ void __launch_bounds__(kThreads) cast_flat_kernel(const void* x, uint8_t* out, int64_t n,
                                                             const float* scale_ptr, float* amax, bool vec) {
  const float scale = *scale_ptr;
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n4; j += stride) {
    float v[4];
    load4<IN>(x, j * 4, v);
    uint32_t packed = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      m = max(m, abs_bits(v[e]));
      packed |= static_cast<uint32_t>(scale_to_fp8<F>(v[e], scale)) << (8 * e);
    }
    reinterpret_cast<uint32_t*>(out)[j] = packed;
  }
  for (int64_t i = n4 * 4 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = load_elem<IN>(x, i);
    m = max(m, abs_bits(v));
    out[i] = scale_to_fp8<F>(v, scale);
  }
  reduce_amax(m, amax);
}

// blockDim (16, 16): thread (tx, ty) reads rows ty*4..+3, columns tx*4..+3 of the tile,
// then writes out_t rows (tile columns) ty*4..+3, positions (tile rows) tx*4..+3.
template <int IN, int F>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(const void* x, uint8_t* out, uint8_t* out_t,
                                                                  int64_t rows, int64_t cols,
                                                                  const float* scale_ptr, float* amax, bool vec) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // +4: no bank conflicts on the column reads
  const float scale = *scale_ptr;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  uint32_t m = 0;
  const bool full = vec && r0 + kTile <= rows && c0 + kTile <= cols;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int r = ty * 4 + rr;
    const int64_t base = (r0 + r) * cols + c0 + tx * 4;
    if (full) {
      float v[4];
      load4<IN>(x, base, v);
      uint32_t packed = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        m = max(m, abs_bits(v[e]));
        const uint8_t b = scale_to_fp8<F>(v[e], scale);
        tile[r][tx * 4 + e] = b;
        packed |= static_cast<uint32_t>(b) << (8 * e);
      }
      *reinterpret_cast<uint32_t*>(out + base) = packed;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = tx * 4 + e;
        if (r0 + r < rows && c0 + c < cols) {
          const float v = load_elem<IN>(x, base + e);
          m = max(m, abs_bits(v));
          const uint8_t b = scale_to_fp8<F>(v, scale);
          tile[r][c] = b;
          out[base + e] = b;
        }
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int cc = 0; cc < 4; ++cc) {
    const int c = ty * 4 + cc;  // tile column = out_t row
    const int64_t base = (c0 + c) * rows + r0 + tx * 4;
    if (full) {
      const uint32_t packed = tile[tx * 4][c] | (static_cast<uint32_t>(tile[tx * 4 + 1][c]) << 8) |
                              (static_cast<uint32_t>(tile[tx * 4 + 2][c]) << 16) |
                              (static_cast<uint32_t>(tile[tx * 4 + 3][c]) << 24);
      *reinterpret_cast<uint32_t*>(out_t + base) = packed;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = tx * 4 + e;
        if (r0 + r < rows && c0 + c < cols) out_t[base + e] = tile[r][c];
      }
    }
  }
  reduce_amax(m, amax);
}

int sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 108;
}

template <int IN, int F>
void launch(const CastArgs& a, const float* scale, float* amax, cudaStream_t s) {
  const int64_t n = a.rows * a.cols;
  const uintptr_t xp = reinterpret_cast<uintptr_t>(a.x);
  const int in_bytes = IN == kInF32 ? 4 : 2;
  const bool x_aligned = (xp % (4 * in_bytes)) == 0;
  if (a.out_t == nullptr) {
    const bool vec = x_aligned && (reinterpret_cast<uintptr_t>(a.out) % 4) == 0;
    const int64_t want = std::max<int64_t>(1, (n / 4 + kThreads - 1) / kThreads);
    const int blocks = static_cast<int>(std::min<int64_t>(want, static_cast<int64_t>(sm_count()) * 8));
    cast_flat_kernel<IN, F><<<blocks, kThreads, 0, s>>>(a.x, a.out, n, scale, amax, vec);
  } else {
    // vector path needs every tile row/column start 4-element aligned
    const bool vec = x_aligned && a.cols % 4 == 0 && a.rows % 4 == 0 &&
                     (reinterpret_cast<uintptr_t>(a.out) % 4) == 0 && (reinterpret_cast<uintptr_t>(a.out_t) % 4) == 0;
    const dim3 grid(static_cast<unsigned>((a.cols + kTile - 1) / kTile), static_cast<unsigned>((a.rows + kTile - 1) / kTile));
    if (grid.y > 65535) throw std::runtime_error("engine_fp8::cast: too many rows for the transpose kernel");
    cast_transpose_kernel<IN, F><<<grid, dim3(16, 16), 0, s>>>(a.x, a.out, a.out_t, a.rows, a.cols, scale, amax, vec);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("engine_fp8::cast CUDA launch failed: ") + cudaGetErrorString(err));
  }
}

}  // namespace

void cast_cuda(const CastArgs& a, const float* scale, float* amax, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaMemsetAsync(amax, 0, sizeof(float), s);
  if (a.rows * a.cols == 0) return;
  switch (a.in_type * 2 + a.format) {
    case kInF32 * 2 + kE4M3: return launch<kInF32, kE4M3>(a, scale, amax, s);
    case kInF32 * 2 + kE5M2: return launch<kInF32, kE5M2>(a, scale, amax, s);
    case kInBF16 * 2 + kE4M3: return launch<kInBF16, kE4M3>(a, scale, amax, s);
    case kInBF16 * 2 + kE5M2: return launch<kInBF16, kE5M2>(a, scale, amax, s);
    case kInF16 * 2 + kE4M3: return launch<kInF16, kE4M3>(a, scale, amax, s);
    default: return launch<kInF16, kE5M2>(a, scale, amax, s);
  }
}

}  // namespace fp8
}  // namespace engine
