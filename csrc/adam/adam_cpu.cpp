// AdamW on the CPU: one pass per element (read p, g, m, v; write p, m, v and the
// optional bf16/fp16 copy of p). The span loop is compiled for AVX-512, AVX2+FMA and
// baseline x86-64 through target attributes and picked at run time, so the library
// needs no -march flag. Threads come from the frontend (at::parallel_for over chunks).
#include <atomic>
#include <string>
#include <type_traits>

#include "adam_kernel.h"

namespace engine {
namespace adam {
namespace {

template <int G>
using GradT = std::conditional_t<G == kF32, float, uint16_t>;

template <int G>
ENGINE_HD float load_grad(const GradT<G>* g, int64_t i) {
  if constexpr (G == kF32) {
    return g[i];
  } else if constexpr (G == kBF16) {
    return bf16_to_float(g[i]);
  } else {
    return fp16_to_float(g[i]);
  }
}

// Restrict-qualified parameters (GCC honours restrict on parameters, not on locals
// loaded from a struct): without them the vectorizer versions the loop on a run-time
// alias check that sends the copy-writing variants down the scalar path.
template <int G, int C>
ENGINE_HD void block(float* __restrict p, const GradT<G>* __restrict g, float* __restrict m,
                     float* __restrict v, uint16_t* __restrict c, int64_t n, const Scalars k) {
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_element(pi, load_grad<G>(g, i), mi, vi, k);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (C == kBF16) c[i] = float_to_bf16(pi);
    if constexpr (C == kF16) c[i] = float_to_fp16(pi);
  }
}

// Out of cache the step is bound by memory: the hardware prefetcher stops at each 4 KB
// page, so every stream starts a page cold. One software prefetch per stream and cache
// line, kAhead elements ahead, keeps the loads in flight across page boundaries.
constexpr int64_t kLine = 16;     // fp32 elements per 64-byte line
constexpr int64_t kAhead = 1024;  // 4 KB: one page ahead

template <int G, int C>
ENGINE_HD void loop(float* p, const GradT<G>* g, float* m, float* v, uint16_t* c, int64_t n, const Scalars& k) {
  int64_t i = 0;
  for (; i + kAhead + kLine <= n; i += kLine) {
    __builtin_prefetch(p + i + kAhead, 1, 3);
    __builtin_prefetch(m + i + kAhead, 1, 3);
    __builtin_prefetch(v + i + kAhead, 1, 3);
    if (G == kF32 || (i & 31) == 0) __builtin_prefetch(g + i + kAhead, 0, 3);
    block<G, C>(p + i, g + i, m + i, v + i, c == nullptr ? nullptr : c + i, kLine, k);
  }
  block<G, C>(p + i, g + i, m + i, v + i, c == nullptr ? nullptr : c + i, n - i, k);
}

template <int G, int C>
ENGINE_HD void span_impl(const Span& s, const Scalars& k) {
  loop<G, C>(s.p, static_cast<const GradT<G>*>(s.g), s.m, s.v, static_cast<uint16_t*>(s.copy), s.n, k);
}

#define ENGINE_ADAM_SWITCH_COPY(G, s, k)                 \
  switch (copy_type) {                                   \
    case kBF16: return span_impl<G, kBF16>(s, k);        \
    case kF16: return span_impl<G, kF16>(s, k);          \
    default: return span_impl<G, kNone>(s, k);           \
  }

#define ENGINE_ADAM_VARIANT(SUFFIX, ATTR)                                            \
  ATTR void span_##SUFFIX(const Span& s, int g_type, int copy_type, const Scalars& k) { \
    switch (g_type) {                                                                \
      case kBF16: ENGINE_ADAM_SWITCH_COPY(kBF16, s, k)                               \
      case kF16: ENGINE_ADAM_SWITCH_COPY(kF16, s, k)                                 \
      default: ENGINE_ADAM_SWITCH_COPY(kF32, s, k)                                   \
    }                                                                                \
  }

ENGINE_ADAM_VARIANT(baseline, )
#if defined(__x86_64__) && defined(__GNUC__)
ENGINE_ADAM_VARIANT(avx2, __attribute__((target("avx2,fma,f16c"))))
ENGINE_ADAM_VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))))
#endif

using Fn = void (*)(const Span&, int, int, const Scalars&);
struct Variant {
  Fn fn;
  const char* name;
};

// Best supported variant not above `limit` (0 = avx512, 1 = avx2, 2 = baseline).
Variant pick_variant(int limit = 0) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (limit <= 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return {span_avx512, "avx512"};
  }
  if (limit <= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {span_avx2, "avx2"};
#endif
  return {span_baseline, "baseline"};
}

// Chosen once from the CPU's features; tests may force a lower supported variant
// (set_cpu_isa) to check that every variant gives the same bits.
const Variant& default_variant() {
  static const Variant v = pick_variant();
  return v;
}

Variant g_forced{};
std::atomic<const Variant*> g_variant{nullptr};

const Variant& variant() {
  const Variant* v = g_variant.load(std::memory_order_acquire);
  return v != nullptr ? *v : default_variant();
}

}  // namespace

void adamw_span_cpu(const Span& s, int g_type, int copy_type, const Scalars& k) {
  variant().fn(s, g_type, copy_type, k);
}

const char* cpu_isa() { return variant().name; }

const char* set_cpu_isa(const char* name) {
  const std::string want(name);
  const int limit = want == "avx512" ? 0 : (want == "avx2" ? 1 : 2);
  g_forced = pick_variant(limit);  // test hook: call only while no kernel is running
  g_variant.store(&g_forced, std::memory_order_release);
  return g_forced.name;
}

}  // namespace adam
}  // namespace engine
