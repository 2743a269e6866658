// torch.ops.engine_adam: schema, argument checks and the CPU implementation of the
// fused AdamW step over a list of tensors. CUDA registers in adam_cuda_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "adam_kernel.h"

namespace engine {
namespace adam {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

// Shared with adam_cuda_ops.cpp. Returns (grad dtype code, copy dtype code).
std::pair<int, int> check_lists(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                at::TensorList exp_avg_sqs, at::TensorList copies) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "engine_adam::adamw_step: params, grads, exp_avgs and exp_avg_sqs must have the same length, got ",
              n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK(copies.empty() || copies.size() == n,
              "engine_adam::adamw_step: param_copies must be empty or one per param, got ", copies.size(),
              " for ", n, " params");
  const int g_type = n ? dtype_code(grads[0]) : kF32;
  const int c_type = copies.empty() ? kNone : dtype_code(copies[0]);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.scalar_type() == at::kFloat,
                "engine_adam::adamw_step: params must be float32 (master weights), param ", i, " is ",
                p.scalar_type(), "; keep fp32 masters and pass the low-precision copy as param_copies");
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat && exp_avg_sqs[i].scalar_type() == at::kFloat,
                "engine_adam::adamw_step: exp_avg/exp_avg_sq must be float32 (tensor ", i, ")");
    TORCH_CHECK(dtype_code(grads[i]) >= 0 && dtype_code(grads[i]) == g_type,
                "engine_adam::adamw_step: grads must all be float32, or all bfloat16, or all float16; grad ", i,
                " is ", grads[i].scalar_type());
    const int64_t numel = p.numel();
    TORCH_CHECK(grads[i].numel() == numel && exp_avgs[i].numel() == numel && exp_avg_sqs[i].numel() == numel,
                "engine_adam::adamw_step: tensor ", i, " has mismatched numels (param ", numel, ", grad ",
                grads[i].numel(), ", exp_avg ", exp_avgs[i].numel(), ", exp_avg_sq ", exp_avg_sqs[i].numel(), ")");
    TORCH_CHECK(p.is_contiguous() && grads[i].is_contiguous() && exp_avgs[i].is_contiguous() &&
                    exp_avg_sqs[i].is_contiguous(),
                "engine_adam::adamw_step: tensor ", i, " (param/grad/exp_avg/exp_avg_sq) is not contiguous");
    TORCH_CHECK(!grads[i].is_sparse(), "engine_adam::adamw_step: sparse gradients are not supported");
    const auto dev = p.device();
    TORCH_CHECK(grads[i].device() == dev && exp_avgs[i].device() == dev && exp_avg_sqs[i].device() == dev,
                "engine_adam::adamw_step: tensor ", i, ": param, grad and states must be on one device");
    if (!copies.empty()) {
      const at::Tensor& c = copies[i];
      TORCH_CHECK(c_type == kBF16 || c_type == kF16,
                  "engine_adam::adamw_step: param_copies must be bfloat16 or float16, got ", copies[0].scalar_type());
      TORCH_CHECK(dtype_code(c) == c_type && c.numel() == numel && c.is_contiguous() && c.device() == dev,
                  "engine_adam::adamw_step: param copy ", i, " must be a contiguous ", copies[0].scalar_type(),
                  " tensor with ", numel, " elements on ", dev);
    }
  }
  return {g_type, c_type};
}

namespace {

constexpr int64_t kChunk = int64_t{1} << 15;  // elements per task (~640 KB of traffic)

void adamw_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList copies, double lr, double beta1, double beta2,
                    double eps, double weight_decay, double step, bool bias_correction, bool maximize) {
  const auto [g_type, c_type] = check_lists(params, grads, exp_avgs, exp_avg_sqs, copies);
  const Scalars k = make_scalars(lr, beta1, beta2, eps, weight_decay, step, bias_correction, maximize);
  // Split every tensor into chunks so one parallel_for balances many small and a few
  // large tensors alike.
  std::vector<Span> chunks;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    const int gsz = g_type == kF32 ? 4 : 2;
    for (int64_t b = 0; b < n; b += kChunk) {
      Span s{};
      s.p = params[i].data_ptr<float>() + b;
      s.g = static_cast<const char*>(grads[i].data_ptr()) + b * gsz;
      s.m = exp_avgs[i].data_ptr<float>() + b;
      s.v = exp_avg_sqs[i].data_ptr<float>() + b;
      s.copy = copies.empty() ? nullptr : static_cast<void*>(static_cast<char*>(copies[i].data_ptr()) + b * 2);
      s.n = std::min(kChunk, n - b);
      chunks.push_back(s);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) adamw_span_cpu(chunks[c], g_type, c_type, k);
  });
}

std::string isa() { return cpu_isa(); }
std::string force_isa(const std::string& name) { return set_cpu_isa(name.c_str()); }

}  // namespace
}  // namespace adam
}  // namespace engine

TORCH_LIBRARY(engine_adam, m) {
  m.def(
      "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] param_copies, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "float step, bool bias_correction, bool maximize) -> ()");
  m.def("cpu_isa() -> str", &engine::adam::isa);
  m.def("set_cpu_isa(str name) -> str", &engine::adam::force_isa);
}

TORCH_LIBRARY_IMPL(engine_adam, CPU, m) { m.impl("adamw_step", &engine::adam::adamw_step_cpu); }
