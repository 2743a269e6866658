// CUDA registration of engine_fp8::cast (the schema lives in fp8_ops.cpp).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "fp8_kernel.h"

namespace engine {
namespace fp8 {

// fp8_ops.cpp
CastArgs check_and_describe(const at::Tensor& x, const at::Tensor& scale, int64_t format);
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_outputs(const at::Tensor& x, const CastArgs& a,
                                                                bool transpose);

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_cuda_op(const at::Tensor& x, const at::Tensor& scale,
                                                            int64_t format, bool transpose) {
  const c10::cuda::CUDAGuard guard(x.device());
  CastArgs a = check_and_describe(x, scale, format);
  auto [out, amax, out_t] = allocate_outputs(x, a, transpose);
  a.x = x.data_ptr();
  a.out = static_cast<uint8_t*>(out.data_ptr());
  a.out_t = transpose ? static_cast<uint8_t*>(out_t.data_ptr()) : nullptr;
  // The scale stays on the device (no sync); the kernel reads it.
  cast_cuda(a, scale.data_ptr<float>(), amax.data_ptr<float>(),
            c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  return {out, amax, out_t};
}

}  // namespace
}  // namespace fp8
}  // namespace engine

TORCH_LIBRARY_IMPL(engine_fp8, CUDA, m) { m.impl("cast", &engine::fp8::cast_cuda_op); }
