// AdamW on CUDA: a multi-tensor kernel. The host packs up to kMaxTensors tensors and
// kMaxBlocks chunks of kChunk elements into the kernel's parameter block (< 4 KB), so one
// launch updates many tensors; each thread block updates one chunk, 4 elements per
// thread per iteration with 16-byte loads when every pointer allows it.
//
// Per element the maths is adamw_element (adam_kernel.h), the same function the CPU
// kernel runs; compiled with --fmad=false, so CPU and GPU round identically.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "adam_kernel.h"

namespace engine {
namespace adam {
namespace {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct TensorListMeta {
  float* p[kMaxTensors];
  const void* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  void* copy[kMaxTensors];
  int64_t n[kMaxTensors];
  unsigned char tensor_of_block[kMaxBlocks];
  int chunk_of_block[kMaxBlocks];
};
static_assert(sizeof(TensorListMeta) + sizeof(Scalars) < 4000, "kernel parameters must stay under 4 KB");

template <int G>
__device__ __forceinline__ float load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (G == kBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
  } else {
    return fp16_to_float(static_cast<const uint16_t*>(g)[i]);
  }
}

template <int C>
__device__ __forceinline__ void store_copy(void* c, int64_t i, float p) {
  if constexpr (C == kBF16) static_cast<uint16_t*>(c)[i] = float_to_bf16(p);
  if constexpr (C == kF16) static_cast<uint16_t*>(c)[i] = float_to_fp16(p);
}

__device__ __forceinline__ bool aligned16(const void* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0;
}

template <int G, int C>
__global__ void __launch_bounds__(kThreads) adamw_multi_tensor_kernel(TensorListMeta meta, Scalars k) {
  const int t = meta.tensor_of_block[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.chunk_of_block[blockIdx.x]) * kChunk;
  const int64_t n = min(meta.n[t] - start, kChunk);
  float* p = meta.p[t] + start;
  float* m = meta.m[t] + start;
  float* v = meta.v[t] + start;
  const void* g = static_cast<const char*>(meta.g[t]) + start * (G == kF32 ? 4 : 2);
  void* c = C == kNone ? nullptr : static_cast<void*>(static_cast<char*>(meta.copy[t]) + start * 2);
  // 16-byte path: fp32 arrays aligned to 16 B, 16-bit arrays to 8 B, whole groups of 4.
  const bool vec = aligned16(p) && aligned16(m) && aligned16(v) &&
                   (G == kF32 ? aligned16(g) : (reinterpret_cast<uintptr_t>(g) & 7) == 0) &&
                   (C == kNone || (reinterpret_cast<uintptr_t>(c) & 7) == 0);
  const int64_t n_vec = vec ? n / 4 : 0;
  for (int64_t j = threadIdx.x; j < n_vec; j += blockDim.x) {
    float4 pv = reinterpret_cast<float4*>(p)[j];
    float4 mv = reinterpret_cast<float4*>(m)[j];
    float4 vv = reinterpret_cast<float4*>(v)[j];
    float gs[4];
    if constexpr (G == kF32) {
      const float4 gv = reinterpret_cast<const float4*>(g)[j];
      gs[0] = gv.x; gs[1] = gv.y; gs[2] = gv.z; gs[3] = gv.w;
    } else {
      const uint2 raw = reinterpret_cast<const uint2*>(g)[j];
      const uint16_t h[4] = {static_cast<uint16_t>(raw.x & 0xFFFF), static_cast<uint16_t>(raw.x >> 16),
                             static_cast<uint16_t>(raw.y & 0xFFFF), static_cast<uint16_t>(raw.y >> 16)};
#pragma unroll
      for (int e = 0; e < 4; ++e) gs[e] = G == kBF16 ? bf16_to_float(h[e]) : fp16_to_float(h[e]);
    }
    adamw_element(pv.x, gs[0], mv.x, vv.x, k);
    adamw_element(pv.y, gs[1], mv.y, vv.y, k);
    adamw_element(pv.z, gs[2], mv.z, vv.z, k);
    adamw_element(pv.w, gs[3], mv.w, vv.w, k);
    reinterpret_cast<float4*>(p)[j] = pv;
    reinterpret_cast<float4*>(m)[j] = mv;
    reinterpret_cast<float4*>(v)[j] = vv;
    if constexpr (C != kNone) {
      const float ps[4] = {pv.x, pv.y, pv.z, pv.w};
      uint16_t h[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) h[e] = C == kBF16 ? float_to_bf16(ps[e]) : float_to_fp16(ps[e]);
      reinterpret_cast<uint2*>(c)[j] = make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16),
                                                  h[2] | (static_cast<uint32_t>(h[3]) << 16));
    }
  }
  for (int64_t i = n_vec * 4 + threadIdx.x; i < n; i += blockDim.x) {  // tail / unaligned
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_element(pi, load_grad<G>(g, i), mi, vi, k);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_copy<C>(c, i, pi);
  }
}

template <int G, int C>
void launch(const TensorListMeta& meta, int blocks, const Scalars& k, cudaStream_t stream) {
  adamw_multi_tensor_kernel<G, C><<<blocks, kThreads, 0, stream>>>(meta, k);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("engine_adam::adamw_step CUDA launch failed: ") + cudaGetErrorString(err));
  }
}

void dispatch(int g_type, int copy_type, const TensorListMeta& meta, int blocks, const Scalars& k,
              cudaStream_t s) {
#define ENGINE_ADAM_LAUNCH_C(G)                                   \
  switch (copy_type) {                                            \
    case kBF16: return launch<G, kBF16>(meta, blocks, k, s);      \
    case kF16: return launch<G, kF16>(meta, blocks, k, s);        \
    default: return launch<G, kNone>(meta, blocks, k, s);         \
  }
  switch (g_type) {
    case kBF16: ENGINE_ADAM_LAUNCH_C(kBF16)
    case kF16: ENGINE_ADAM_LAUNCH_C(kF16)
    default: ENGINE_ADAM_LAUNCH_C(kF32)
  }
#undef ENGINE_ADAM_LAUNCH_C
}

}  // namespace

void adamw_multi_tensor_cuda(float* const* params, const void* const* grads, float* const* exp_avgs,
                             float* const* exp_avg_sqs, void* const* copies, const int64_t* numels,
                             int n_tensors, int g_type, int copy_type, const Scalars& k, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TensorListMeta meta{};
  int tensors = 0, blocks = 0;
  for (int t = 0; t < n_tensors; ++t) {
    const int64_t n = numels[t];
    if (n == 0) continue;
    meta.p[tensors] = params[t];
    meta.g[tensors] = grads[t];
    meta.m[tensors] = exp_avgs[t];
    meta.v[tensors] = exp_avg_sqs[t];
    meta.copy[tensors] = copies != nullptr ? copies[t] : nullptr;
    meta.n[tensors] = n;
    ++tensors;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      meta.tensor_of_block[blocks] = static_cast<unsigned char>(tensors - 1);
      meta.chunk_of_block[blocks] = static_cast<int>(ch);
      ++blocks;
      const bool blocks_full = blocks == kMaxBlocks;
      const bool tensors_full = tensors == kMaxTensors && ch == chunks - 1;
      const bool last = t == n_tensors - 1 && ch == chunks - 1;
      if (blocks_full || tensors_full || last) {
        dispatch(g_type, copy_type, meta, blocks, k, s);
        blocks = 0;
        if (ch == chunks - 1) {
          tensors = 0;  // this tensor is done
        } else {        // carry the unfinished tensor into the next launch as slot 0
          meta.p[0] = meta.p[tensors - 1];
          meta.g[0] = meta.g[tensors - 1];
          meta.m[0] = meta.m[tensors - 1];
          meta.v[0] = meta.v[tensors - 1];
          meta.copy[0] = meta.copy[tensors - 1];
          meta.n[0] = meta.n[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) dispatch(g_type, copy_type, meta, blocks, k, s);  // trailing empty tensors
}

}  // namespace adam
}  // namespace engine
