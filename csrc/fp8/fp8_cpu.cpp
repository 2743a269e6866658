// FP8 cast on the CPU: scale, saturate, round to nearest even, amax of the input and
// (optionally) the transposed output, in one pass over the input.
//
// The loops are written as plain scalar code with selects (fp8_convert.h) and compiled
// three times through target attributes (AVX-512, AVX2, baseline x86-64); GCC
// vectorizes each. The variant is picked once at run time from the CPU's features, so
// the library itself needs no -march flag and runs on any x86-64.
#include <algorithm>
#include <cstring>

#include <atomic>
#include <string>

#include "fp8_convert.h"
#include "fp8_kernel.h"

namespace engine {
namespace fp8 {
namespace {

template <int IN>
ENGINE_HD float load_elem(const void* p, int64_t i) {
  if constexpr (IN == kInF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (IN == kInBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// n elements from x[offset:] -> out[0:n]; returns max |x| bits (NaN-propagating).
template <int IN, int F>
ENGINE_HD uint32_t cast_span(const void* x, int64_t offset, uint8_t* __restrict out, int64_t n,
                             float scale) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_elem<IN>(x, offset + i);
    const uint32_t a = float_bits(v) & 0x7FFFFFFFu;
    m = a > m ? a : m;
    out[i] = scale_to_fp8<F>(v, scale);
  }
  return m;
}

template <int IN, int F>
ENGINE_HD uint32_t flat_impl(const CastArgs& a, int64_t begin, int64_t end) {
  return cast_span<IN, F>(a.x, begin, a.out + begin, end - begin, a.scale);
}

// Transposed output, per block of kTileRows rows: (1) cast the block's rows straight
// into `out` -- one contiguous, vectorized stream, the input is read exactly once;
// (2) transpose the block, still in L2, into `out_t` through kTileRows x kTileCols local
// tiles. Copying whole 64-byte rows into the tile and writing each out_t row segment
// (64 bytes = one cache line) in one go avoids the L1 set thrashing that byte-wise
// strided access causes when a row stride is a multiple of 4 KiB.
constexpr int64_t kTileRows = 64;
constexpr int64_t kTileCols = 64;

// In-register transpose of an 8x8 byte block held as 8 little-endian uint64 rows:
// swap the off-diagonal 4x4, then 2x2, then 1x1 blocks (three masked XOR rounds).
ENGINE_HD void transpose8x8(uint64_t (&r)[8]) {
  for (int i = 0; i < 4; ++i) {
    const uint64_t t = ((r[i] >> 32) ^ r[i + 4]) & 0x00000000FFFFFFFFull;
    r[i] ^= t << 32;
    r[i + 4] ^= t;
  }
  for (int i : {0, 1, 4, 5}) {
    const uint64_t t = ((r[i] >> 16) ^ r[i + 2]) & 0x0000FFFF0000FFFFull;
    r[i] ^= t << 16;
    r[i + 2] ^= t;
  }
  for (int i : {0, 2, 4, 6}) {
    const uint64_t t = ((r[i] >> 8) ^ r[i + 1]) & 0x00FF00FF00FF00FFull;
    r[i] ^= t << 8;
    r[i + 1] ^= t;
  }
}

// tile (rn x cn bytes) -> dst (cn rows of rn bytes, row stride ld).
ENGINE_HD void transpose_tile(const uint8_t (&tile)[kTileRows][kTileCols], int64_t rn, int64_t cn,
                              uint8_t* dst, int64_t ld) {
  const int64_t rn8 = rn & ~int64_t{7}, cn8 = cn & ~int64_t{7};
  for (int64_t c = 0; c < cn8; c += 8) {    // 8 destination rows at a time ...
    for (int64_t r = 0; r < rn8; r += 8) {  // ... each filled left to right
      uint64_t blk[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&blk[i], &tile[r + i][c], 8);
      transpose8x8(blk);
      for (int i = 0; i < 8; ++i) std::memcpy(dst + (c + i) * ld + r, &blk[i], 8);
    }
  }
  for (int64_t c = 0; c < cn; ++c) {  // ragged edges: fewer than 8 rows or columns left
    for (int64_t r = c < cn8 ? rn8 : 0; r < rn; ++r) dst[c * ld + r] = tile[r][c];
  }
}

template <int IN, int F>
ENGINE_HD uint32_t rows_transpose_impl(const CastArgs& a, int64_t r0, int64_t r1) {
  alignas(64) uint8_t tile[kTileRows][kTileCols];
  uint32_t m = 0;
  const int64_t rows = a.rows, cols = a.cols;
  for (int64_t rb = r0; rb < r1; rb += kTileRows) {
    const int64_t rn = std::min(kTileRows, r1 - rb);
    const uint32_t mb = cast_span<IN, F>(a.x, rb * cols, a.out + rb * cols, rn * cols, a.scale);
    m = mb > m ? mb : m;
    for (int64_t cb = 0; cb < cols; cb += kTileCols) {
      const int64_t cn = std::min(kTileCols, cols - cb);
      for (int64_t r = 0; r < rn; ++r) std::memcpy(tile[r], a.out + (rb + r) * cols + cb, static_cast<size_t>(cn));
      transpose_tile(tile, rn, cn, a.out_t + cb * rows + rb, rows);
    }
  }
  return m;
}

// (in_type, format) -> the instantiation; always inlined into each ISA variant below.
#define ENGINE_FP8_SWITCH(IMPL, a, b, e)                                      \
  switch ((a).in_type * 2 + (a).format) {                                     \
    case kInF32 * 2 + kE4M3: return IMPL<kInF32, kE4M3>(a, b, e);             \
    case kInF32 * 2 + kE5M2: return IMPL<kInF32, kE5M2>(a, b, e);             \
    case kInBF16 * 2 + kE4M3: return IMPL<kInBF16, kE4M3>(a, b, e);           \
    case kInBF16 * 2 + kE5M2: return IMPL<kInBF16, kE5M2>(a, b, e);           \
    case kInF16 * 2 + kE4M3: return IMPL<kInF16, kE4M3>(a, b, e);             \
    default: return IMPL<kInF16, kE5M2>(a, b, e);                             \
  }

#define ENGINE_FP8_VARIANT(SUFFIX, ATTR)                                                \
  ATTR uint32_t flat_##SUFFIX(const CastArgs& a, int64_t b, int64_t e) {                \
    ENGINE_FP8_SWITCH(flat_impl, a, b, e)                                               \
  }                                                                                     \
  ATTR uint32_t rows_t_##SUFFIX(const CastArgs& a, int64_t b, int64_t e) {              \
    ENGINE_FP8_SWITCH(rows_transpose_impl, a, b, e)                                     \
  }

ENGINE_FP8_VARIANT(baseline, )
#if defined(__x86_64__) && defined(__GNUC__)
ENGINE_FP8_VARIANT(avx2, __attribute__((target("avx2,fma,f16c"))))
ENGINE_FP8_VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))))
#endif

using Fn = uint32_t (*)(const CastArgs&, int64_t, int64_t);
struct Variant {
  Fn flat;
  Fn rows_t;
  const char* name;
};

// Best supported variant not above `limit` (0 = avx512, 1 = avx2, 2 = baseline).
Variant pick_variant(int limit = 0) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (limit <= 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return {flat_avx512, rows_t_avx512, "avx512"};
  }
  if (limit <= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {flat_avx2, rows_t_avx2, "avx2"};
  }
#endif
  return {flat_baseline, rows_t_baseline, "baseline"};
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

uint32_t cast_flat_cpu(const CastArgs& a, int64_t begin, int64_t end) {
  return variant().flat(a, begin, end);
}

uint32_t cast_rows_transpose_cpu(const CastArgs& a, int64_t row_begin, int64_t row_end) {
  return variant().rows_t(a, row_begin, row_end);
}

const char* cpu_isa() { return variant().name; }

const char* set_cpu_isa(const char* name) {
  const std::string want(name);
  const int limit = want == "avx512" ? 0 : (want == "avx2" ? 1 : 2);
  g_forced = pick_variant(limit);  // test hook: call only while no kernel is running
  g_variant.store(&g_forced, std::memory_order_release);
  return g_forced.name;
}

}  // namespace fp8
}  // namespace engine
