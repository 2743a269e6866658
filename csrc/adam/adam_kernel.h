// AdamW element update shared by the CPU kernel (adam_cpu.cpp) and the CUDA
// multi-tensor kernel (adam_cuda.cu), plus the interface to the frontends. No torch
// headers, so both kernels compile quickly and the .cu compiles with plain nvcc.
//
// The arithmetic follows torch.optim.AdamW's single-tensor path op by op, including
// where ATen's vectorized CPU kernels use a fused multiply-add (lerp, addcmul), so the
// results match torch to the last bit on the machines we checked. Everything else is
// compiled with contraction off (-ffp-contract=off / nvcc --fmad=false), so the CPU ISA
// variants and the GPU kernel round identically.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/engine_macros.h"

namespace engine {
namespace adam {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Per-call constants, rounded to fp32 exactly where torch rounds them.
struct Scalars {
  float decay;          // 1 - lr * weight_decay                 (param.mul_)
  float lerp_w;         // 1 - beta1                             (exp_avg.lerp_(grad, 1 - beta1))
  float lerp_coeff;     // lerp_w (small weight) or lerp_w - 1 (large weight)
  int lerp_small;       // |lerp_w| < 0.5: torch's lerp switches formula there
  float beta2;          //                                        (exp_avg_sq.mul_(beta2))
  float one_minus_beta2;//                                        (.addcmul_(g, g, value=1 - beta2))
  float bc2_sqrt;       // sqrt(1 - beta2^step) or 1
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step) or -lr          (param.addcdiv_(m, denom, value=.))
  int maximize;
};

inline Scalars make_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                            double step, bool bias_correction, bool maximize) {
  Scalars s{};
  // Python-float (double) arithmetic first, as torch.optim.AdamW does, then fp32.
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.lerp_w = static_cast<float>(1.0 - beta1);
  s.lerp_small = std::fabs(s.lerp_w) < 0.5f;
  s.lerp_coeff = s.lerp_small ? s.lerp_w : s.lerp_w - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
  s.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.maximize = maximize ? 1 : 0;
  return s;
}

// One element. p, m, v: fp32 master param and moments (in/out); g: gradient in fp32.
ENGINE_HD void adamw_element(float& p, float g, float& m, float& v, const Scalars& k) {
  g = k.maximize ? -g : g;
  p = p * k.decay;
  const float diff = g - m;
  // ATen's vectorized lerp: fma(coeff, end - start, small ? start : end)
  m = fmaf(k.lerp_coeff, diff, k.lerp_small ? m : g);
  v = v * k.beta2;
  v = fmaf(k.one_minus_beta2 * g, g, v);  // addcmul: self + (value * t1) * t2, contracted
  const float denom = sqrtf(v) / k.bc2_sqrt + k.eps;
  p = p + (k.neg_step_size * m) / denom;
}

// A contiguous range of one tensor.
struct Span {
  float* p;
  const void* g;   // DType g_type
  float* m;
  float* v;
  void* copy;      // DType copy_type (bf16/fp16) or nullptr
  int64_t n;
};

// CPU: one span, vectorized for the best ISA of this CPU (picked at run time).
void adamw_span_cpu(const Span& s, int g_type, int copy_type, const Scalars& k);
const char* cpu_isa();
// Test hook: force the best variant not above `name` (avx512 > avx2 > baseline).
const char* set_cpu_isa(const char* name);

#ifdef ENGINE_WITH_CUDA
// CUDA: all tensors in as few launches as possible (adam_cuda.cu). Arrays of n_tensors
// device pointers/sizes on the host; copies may be null when copy_type == kNone.
void adamw_multi_tensor_cuda(float* const* params, const void* const* grads, float* const* exp_avgs,
                             float* const* exp_avg_sqs, void* const* copies, const int64_t* numels,
                             int n_tensors, int g_type, int copy_type, const Scalars& k, void* stream);
#endif

}  // namespace adam
}  // namespace engine
