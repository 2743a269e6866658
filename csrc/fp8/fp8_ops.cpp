// torch.ops.engine_fp8: schema, argument checks and the CPU implementation of the
// fused FP8 cast. The CUDA implementation registers itself in fp8_cuda_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <string>
#include <tuple>

#include "fp8_kernel.h"

namespace engine {
namespace fp8 {

// Shared with fp8_cuda_ops.cpp: validates and fills CastArgs (pointers set by caller).
CastArgs check_and_describe(const at::Tensor& x, const at::Tensor& scale, int64_t format) {
  TORCH_CHECK(format == 0 || format == 1,
              "engine_fp8::cast: format must be 0 (float8_e4m3fn) or 1 (float8_e5m2), got ", format);
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "engine_fp8::cast: x must be float32, bfloat16 or float16, got ", dt,
              "; cast it with x.float() first");
  TORCH_CHECK(x.is_contiguous(), "engine_fp8::cast: x must be contiguous (call .contiguous())");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1,
              "engine_fp8::cast: scale must be a float32 tensor with one element, got ",
              scale.scalar_type(), " with ", scale.numel(), " elements");
  TORCH_CHECK(scale.device() == x.device(), "engine_fp8::cast: scale is on ", scale.device(),
              " but x is on ", x.device(), "; move the scale to x's device");
  CastArgs a{};
  a.in_type = dt == at::kFloat ? kInF32 : (dt == at::kBFloat16 ? kInBF16 : kInF16);
  a.format = static_cast<int>(format);
  a.cols = x.dim() == 0 ? 1 : x.size(-1);
  a.rows = 1;  // product of the leading dims (also right when some size is 0)
  for (int64_t d = 0; d + 1 < x.dim(); ++d) a.rows *= x.size(d);
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_outputs(const at::Tensor& x, const CastArgs& a,
                                                                bool transpose) {
  const auto fp8 = a.format == 0 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(fp8));
  at::Tensor out_t = transpose ? at::empty({a.cols, a.rows}, x.options().dtype(fp8))
                               : at::empty({0}, x.options().dtype(fp8));
  at::Tensor amax = at::empty({}, x.options().dtype(at::kFloat));
  return {out, amax, out_t};
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_cpu(const at::Tensor& x, const at::Tensor& scale,
                                                        int64_t format, bool transpose) {
  CastArgs a = check_and_describe(x, scale, format);
  auto [out, amax, out_t] = allocate_outputs(x, a, transpose);
  a.x = x.data_ptr();
  a.out = static_cast<uint8_t*>(out.data_ptr());
  a.out_t = transpose ? static_cast<uint8_t*>(out_t.data_ptr()) : nullptr;
  a.scale = scale.item<float>();
  // Partial maxima of |x| bits from each thread; integer max == float max for |x|.
  std::atomic<uint32_t> amax_bits{0};
  auto merge = [&amax_bits](uint32_t m) {
    uint32_t cur = amax_bits.load(std::memory_order_relaxed);
    while (m > cur && !amax_bits.compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
    }
  };
  if (transpose) {
    // grain: enough rows for ~64K elements per task, at least one 32-row tile
    const int64_t grain = std::max<int64_t>(32, (int64_t{1} << 16) / std::max<int64_t>(a.cols, 1));
    at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
      merge(cast_rows_transpose_cpu(a, r0, r1));
    });
  } else {
    at::parallel_for(0, x.numel(), int64_t{1} << 16, [&](int64_t b, int64_t e) {
      merge(cast_flat_cpu(a, b, e));
    });
  }
  const uint32_t bits = amax_bits.load();
  float value;
  static_assert(sizeof(value) == sizeof(bits));
  std::memcpy(&value, &bits, sizeof(value));
  *amax.data_ptr<float>() = value;
  return {out, amax, out_t};
}

std::string isa() { return cpu_isa(); }
std::string force_isa(const std::string& name) { return set_cpu_isa(name.c_str()); }

}  // namespace
}  // namespace fp8
}  // namespace engine

TORCH_LIBRARY(engine_fp8, m) {
  m.def("cast(Tensor x, Tensor scale, int format, bool transpose) -> (Tensor out, Tensor amax, Tensor out_t)");
  m.def("cpu_isa() -> str", &engine::fp8::isa);
  m.def("set_cpu_isa(str name) -> str", &engine::fp8::force_isa);
}

TORCH_LIBRARY_IMPL(engine_fp8, CPU, m) { m.impl("cast", &engine::fp8::cast_cpu); }
