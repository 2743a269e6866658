// CUDA registration of engine_adam::adamw_step (the schema lives in adam_ops.cpp).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "adam_kernel.h"

namespace engine {
namespace adam {

// adam_ops.cpp
std::pair<int, int> check_lists(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                at::TensorList exp_avg_sqs, at::TensorList copies);

namespace {

void adamw_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, double lr, double beta1, double beta2,
                     double eps, double weight_decay, double step, bool bias_correction, bool maximize) {
  const auto [g_type, c_type] = check_lists(params, grads, exp_avgs, exp_avg_sqs, copies);
  if (params.empty()) return;
  const auto device = params[0].device();
  for (const auto& p : params) {
    TORCH_CHECK(p.device() == device, "engine_adam::adamw_step: all tensors of one call must be on one GPU");
  }
  const c10::cuda::CUDAGuard guard(device);
  const size_t n = params.size();
  std::vector<float*> p(n), m(n), v(n);
  std::vector<const void*> g(n);
  std::vector<void*> c(n, nullptr);
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = params[i].data_ptr<float>();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
    if (!copies.empty()) c[i] = copies[i].data_ptr();
    numel[i] = params[i].numel();
  }
  const Scalars k = make_scalars(lr, beta1, beta2, eps, weight_decay, step, bias_correction, maximize);
  adamw_multi_tensor_cuda(p.data(), g.data(), m.data(), v.data(), copies.empty() ? nullptr : c.data(),
                          numel.data(), static_cast<int>(n), g_type, c_type, k,
                          c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

}  // namespace
}  // namespace adam
}  // namespace engine

TORCH_LIBRARY_IMPL(engine_adam, CUDA, m) { m.impl("adamw_step", &engine::adam::adamw_step_cuda); }
