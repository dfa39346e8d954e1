// The per-chunk loops of the CPU kernels (quantize.cpp, wire.cpp): stats, nearest codes
// and decoding of runs of fp32 values, plus the OpenMP range splitter. All helpers are
// forced inline so that each ISA variant of a range driver (cpu/isa.h) compiles them for
// its own ISA; format and symmetry are template parameters, fixed once per call.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu/convert.h"
#include "cpu/isa.h"
#include "qcoll/quant_math.h"

#define QCOLL_INLINE inline __attribute__((always_inline))
// On every lambda of a driver: one left out of line is compiled once, for the baseline ISA.
#define QCOLL_LAMBDA __attribute__((always_inline))

namespace qcoll {
namespace cpu {

// Below this many elements a call runs on one thread: a parallel region costs more.
constexpr int64_t kParallelThreshold = 1 << 15;

// Points at `m` fp32 values of `src`: the source itself for fp32, else `buf` converted.
QCOLL_INLINE const float* as_float(const char* src, DType t, int64_t m, float* buf) {
  if (t == DType::kFloat32) return reinterpret_cast<const float*>(src);
  load_as_float(src, t, m, buf);
  return buf;
}

// Integer max/min reductions on the float bits (see quant_math.h); they vectorize.
template <bool kSym>
QCOLL_INLINE void accumulate_stats(const float* x, int64_t m, math::GroupStats& s) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(x);
  uint32_t abs_bits = s.abs_bits;
  if constexpr (kSym) {
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t a = u[i] & 0x7fffffffu;
      abs_bits = a > abs_bits ? a : abs_bits;
    }
    s.abs_bits = abs_bits;
    return;
  }
  int32_t lo = s.lo_key, hi = s.hi_key;
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t a = u[i] & 0x7fffffffu;
    const int32_t k = math::sortable_key(u[i]);
    abs_bits = a > abs_bits ? a : abs_bits;
    lo = k < lo ? k : lo;
    hi = k > hi ? k : hi;
  }
  s.abs_bits = abs_bits;
  s.lo_key = lo;
  s.hi_key = hi;
}

// m codes from code(i) (the low bits of the code of element i) packed into bytes.
template <CodeFormat kF, typename Code>
QCOLL_INLINE void pack_codes(int64_t m, uint8_t* out, const Code& code) {
  if constexpr (code_bits(kF) == 8) {
    for (int64_t i = 0; i < m; ++i) out[i] = code(i);
  } else {
    const int64_t pairs = m / 2;
    for (int64_t i = 0; i < pairs; ++i)
      out[i] = static_cast<uint8_t>(code(2 * i) | (code(2 * i + 1) << 4));
    if (m & 1) out[pairs] = code(m - 1);  // odd tail: high nibble 0
  }
}

// The largest |x / scale| of a group's codes (beyond it they clamp or saturate).
template <CodeFormat kF, bool kSym>
constexpr float code_range() {
  return kF == CodeFormat::kFp8E4M3 ? 448.0f : kSym ? (kF == CodeFormat::kInt4 ? 7.0f : 127.0f)
                                                    : (kF == CodeFormat::kInt4 ? 15.0f : 255.0f);
}

// Nearest codes by x * fl(1 / scale) instead of the exact quotient fl(x / scale), which
// costs a division per element. With both correctly rounded and 1 / scale normal, the
// product is within 1.6 * 2^-23 * |v| of the quotient v, so both round to the same code
// unless the product lies that close to a rounding boundary: a half-integer for the integer
// formats; for fp8, a midpoint between E4M3 values (low 20 fp32 mantissa bits 0x80000 in the
// normal range, a half-multiple of 2^-9 below 2^-6). Returns false, leaving out to be
// rewritten, when some value was that close (about 1 in 8000 for int8): the caller then
// codes the piece by division, so the codes are the quotient's bit for bit.
template <bool kSym, CodeFormat kF>
QCOLL_INLINE bool code_nearest_reciprocal(const float* x, int64_t m, const math::GroupParams& p,
                                          uint8_t* out) {
  const float scale = p.scale, offset = p.offset;
  if (!(scale >= 0x1p-126f && scale <= 0x1p126f)) return false;  // 1 / scale not normal
  const float r = 1.0f / scale;
  // Half-integer margin: 8x the bound above for |v| <= code_range + 1, a power of two.
  constexpr float kMargin = (code_range<kF, kSym>() + 1.0f) * 0x1p-20f;
  uint32_t near = 0;
  pack_codes<kF>(m, out, [&](int64_t i) QCOLL_LAMBDA {
    const float d = kSym ? x[i] : math::sub(x[i], offset);
    const float y = math::mul(d, r);
    if constexpr (kF == CodeFormat::kFp8E4M3) {
      const uint32_t a = math::float_bits(y) & 0x7fffffffu;
      const uint32_t low = (a & 0xfffffu) - (0x80000u - 32u);  // < 64: within 32 ulps of a midpoint
      const float z = math::mul(math::bits_float(a), 512.0f);  // exact: the 2^-9 grid as integers
      const float f = math::sub(z, math::round_half_even(z));
      const uint32_t sub_near = (math::float_bits(f) & 0x7fffffffu) >= math::float_bits(0.5f - 0x1p-16f);
      const uint32_t is_sub = a < 0x3c800000u;  // below 2^-6: the subnormal grid
      near |= (is_sub & sub_near) | ((is_sub ^ 1u) & static_cast<uint32_t>(low < 64u));  // bitwise: vectorizes
      return math::fp8_e4m3_encode(y);
    } else {
      const float q = math::round_half_even(y);
      const float f = math::sub(y, q);  // exact
      near |= static_cast<uint32_t>((math::float_bits(f) & 0x7fffffffu) >=
                                    math::float_bits(0.5f - kMargin));
      constexpr float lo = kSym ? -code_range<kF, kSym>() : 0.0f;
      return math::code_to_bits(math::clampf(q, lo, code_range<kF, kSym>()), kF);
    }
  });
  return near == 0;
}

// Nearest-rounded codes of m values straight into packed bytes; branch-free so it
// vectorizes (the group's scale is > 0 here).
template <bool kSym, CodeFormat kF>
QCOLL_INLINE void code_nearest(const float* x, int64_t m, const math::GroupParams& p, uint8_t* out) {
  if (code_nearest_reciprocal<kSym, kF>(x, m, p, out)) return;
  const math::GroupParams params = p;  // a local copy: byte stores cannot alias it
  pack_codes<kF>(m, out, [&](int64_t i) QCOLL_LAMBDA {
    return math::encode_scaled<kSym>(x[i], params, kF, false, 0.0f);
  });
}

// Stochastic codes: the draws of a block of values first (the counter-based hash
// vectorizes on its own), then their codes.
template <bool kSym, CodeFormat kF>
QCOLL_INLINE void code_stochastic(const float* x, int64_t m, const math::GroupParams& p,
                                  uint64_t key, uint64_t index0, uint8_t* out) {
  constexpr int64_t kDraws = 256;  // even: int4 blocks start on whole bytes
  alignas(64) float u[kDraws];
  const math::GroupParams params = p;
  for (int64_t b = 0; b < m; b += kDraws) {
    const int64_t k = std::min(kDraws, m - b);
    const uint64_t i0 = index0 + static_cast<uint64_t>(b);
    for (int64_t i = 0; i < k; ++i) u[i] = math::uniform01(key, i0 + static_cast<uint64_t>(i));
    const float* xb = x + b;
    pack_codes<kF>(k, out + code_bytes(b, kF), [&](int64_t i) QCOLL_LAMBDA {
      return math::encode_scaled<kSym>(xb[i], params, kF, true, u[i]);
    });
  }
}

// Codes of m values of a group (index0: the stochastic-rounding index of x[0]); reads no
// values when the group's codes are all zero.
template <CodeFormat kF, bool kSym>
QCOLL_INLINE void code_piece(const float* x, int64_t m, const math::GroupParams& p,
                             bool stochastic, uint64_t key, uint64_t index0, uint8_t* out) {
  if (math::codes_are_zero(p)) {
    std::memset(out, 0, static_cast<size_t>(code_bytes(m, kF)));
  } else if (stochastic) {
    code_stochastic<kSym, kF>(x, m, p, key, index0, out);
  } else {
    code_nearest<kSym, kF>(x, m, p, out);
  }
}

// The group encoder of the CPU quantize and wire kernels (bit-identity in one place): a
// group of m elements whose fp32 values values(c, k) gives piecewise (elements [c, c + k),
// c a multiple of `piece`, k <= piece). Pass 1 gathers the statistics over the pieces;
// pass 2 calls code(x, c, k, params) for the codes. A group of one piece keeps its values
// from pass 1 (in L1: one read of memory), and so does a group whose codes are all zero
// (coded whole, values unread); larger groups recompute each piece. Returns the group's
// parameters. The callers' lambdas are always_inline, so the ISA variants of their range
// drivers vectorize them too.
template <CodeFormat kF, bool kSym, typename Values, typename Code>
QCOLL_INLINE math::GroupParams encode_group(int64_t m, int64_t piece, const Values& values,
                                            const Code& code) {
  math::GroupStats stats = math::stats_identity();
  const float* x = nullptr;
  for (int64_t c = 0; c < m; c += piece) {
    const int64_t k = std::min(piece, m - c);
    x = values(c, k);
    accumulate_stats<kSym>(x, k, stats);
  }
  const math::GroupParams p = math::group_params(stats, kF, kSym);
  if (m <= piece || math::codes_are_zero(p)) {
    code(x, int64_t{0}, m, p);
    return p;
  }
  for (int64_t c = 0; c < m; c += piece) {
    const int64_t k = std::min(piece, m - c);
    code(values(c, k), c, k, p);
  }
  return p;
}

// The value of every fp8_e4m3 byte (math::fp8_e4m3_decode, computed once): the decode of
// the AVX2 and baseline paths.
inline const float* fp8_e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = math::fp8_e4m3_decode(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// Calls f(value), value(b) being math::decode_value(b, p, kF, sym) (fp8: symmetric only).
// fp8 decodes by its bit assembly on the AVX-512 path, which vectorizes it (1.7-1.8x the
// table's speed); the narrower paths look it up in the table, which GCC assembles from
// scalar loads faster than their vectors do the selects (AVX2: the bits 1.1-1.3x slower
// there, baseline 1.8-1.9x). Both give math::fp8_e4m3_decode's bits.
template <CodeFormat kF, typename F>
QCOLL_INLINE void with_code_values(const math::GroupParams& p, bool sym, F&& f) {
  if constexpr (kF == CodeFormat::kFp8E4M3) {
    if (active_isa() == Isa::kAvx512)
      return f([p](uint8_t b) QCOLL_LAMBDA { return math::mul(math::fp8_e4m3_decode(b), p.scale); });
    const float* table = fp8_e4m3_values();
    return f([p, table](uint8_t b) QCOLL_LAMBDA { return math::mul(table[b], p.scale); });
  } else {
    return f([p, sym](uint8_t b) QCOLL_LAMBDA { return math::decode_value(b, p, kF, sym); });
  }
}

// Values of m codes into fp32 (the output buffer itself when the output is fp32).
template <CodeFormat kF>
QCOLL_INLINE void decode_chunk_as(const uint8_t* in, int64_t m, const math::GroupParams& p, bool sym,
                                  float* out) {
  with_code_values<kF>(p, sym, [&](const auto& value) QCOLL_LAMBDA {
    if constexpr (code_bits(kF) == 8) {
      for (int64_t i = 0; i < m; ++i) out[i] = value(in[i]);
      return;
    }
    const int64_t pairs = m / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      out[2 * i] = value(in[i]);
      out[2 * i + 1] = value(static_cast<uint8_t>(in[i] >> 4));
    }
    if (m & 1) out[m - 1] = value(in[pairs]);
  });
}

QCOLL_INLINE void decode_chunk(const uint8_t* in, int64_t m, const math::GroupParams& p,
                               CodeFormat format, bool sym, float* out) {
  with_format(format, [&](auto f) QCOLL_LAMBDA { decode_chunk_as<decltype(f)::value>(in, m, p, sym, out); });
}

// Packets of 8 and 16 floats as vectors (one ymm / zmm with AVX2 / AVX-512; narrower
// registers otherwise).
typedef float Vec8f __attribute__((vector_size(32)));
typedef int32_t Vec8i __attribute__((vector_size(32)));
typedef float Vec16f __attribute__((vector_size(64)));
typedef int32_t Vec16i __attribute__((vector_size(64)));

template <typename V>
QCOLL_INLINE V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
QCOLL_INLINE void store_vec(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// The stage of stride kStride (below the vector's width) of the transform on one vector, as
// a shuffle and adds: each lane gets mine + partner (lower) or partner - mine (upper), the
// operations of math::hadamard8 / math::butterfly. partner - mine is computed as
// partner + (-mine), mine's sign bit flipped: IEEE defines subtraction so (same bits, zeros'
// signs included; only a NaN's bits may differ, and every NaN is canonicalized or makes its
// group non-finite). One add and a flip instead of an add, a subtract and a blend: the
// transform 1.25x faster on AVX-512 (bench/results/hadamard-stage-cpu.txt).
template <int kStride, typename V, typename I, int... kLane>
QCOLL_INLINE V hadamard_stage(V v, std::integer_sequence<int, kLane...>) {
  constexpr I partner = {(kLane ^ kStride)...};
  constexpr I upper_sign = {((kLane & kStride) ? INT32_MIN : 0)...};
  const V w = __builtin_shuffle(v, partner);
  return w + reinterpret_cast<V>(reinterpret_cast<I>(v) ^ upper_sign);
}
template <int kStride, typename V, typename I>
QCOLL_INLINE V hadamard_stage(V v) {
  return hadamard_stage<kStride, V, I>(v, std::make_integer_sequence<int, sizeof(V) / 4>{});
}

// The stages of strides 1 to kLanes / 2 on one vector of kLanes floats.
template <typename V, typename I>
QCOLL_INLINE V hadamard_in_vector(V v) {
  v = hadamard_stage<4, V, I>(hadamard_stage<2, V, I>(hadamard_stage<1, V, I>(v)));
  if constexpr (sizeof(V) == 64) v = hadamard_stage<8, V, I>(v);
  return v;
}

// The stages between the kV vectors of r, vector strides 1 to kV / 2, in that order.
template <typename V, int kV>
QCOLL_INLINE void hadamard_across(V (&r)[kV]) {
#pragma GCC unroll 16
  for (int s = 1; s < kV; s *= 2)
#pragma GCC unroll 16
    for (int j = 0; j < kV; ++j)
      if (!(j & s)) {
        const V lo = r[j], hi = r[j + s];
        r[j] = lo + hi;
        r[j + s] = lo - hi;
      }
}

// One block of kSize elements of src (a multiple of the vector's width), transformed into
// dst (which may be src), with kRegs vectors held in registers at a time: each run of
// kRegs vectors through every stage within it, the stages within a vector as shuffles, the
// others between vectors; then, for a block longer than a run, the stages between runs, on
// the vectors at the same place of each run, and the norm. quant_math.h's operations in
// its stage order, so bit-identical to any other schedule. AVX-512 (16 vectors of 16) holds
// a whole block of 256, AVX2 (8 of 8) a run of 64: two passes over a block, not one a stage.
template <typename V, typename I, int kRegs, int kSize>
QCOLL_INLINE void hadamard_block(const float* src, float* dst, float norm) {
  constexpr int kLanes = static_cast<int>(sizeof(V) / 4);
  constexpr int kRun = kSize < kRegs * kLanes ? kSize : kRegs * kLanes;  // floats in registers
  constexpr int kV = kRun / kLanes, kRuns = kSize / kRun;
#pragma GCC unroll 4
  for (int b = 0; b < kSize; b += kRun) {
    V r[kV];
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) r[v] = hadamard_in_vector<V, I>(load_vec<V>(src + b + kLanes * v));
    hadamard_across(r);
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) store_vec(dst + b + kLanes * v, kRuns == 1 ? r[v] * norm : r[v]);
  }
  if constexpr (kRuns > 1) {
#pragma GCC unroll 8
    for (int c = 0; c < kRun; c += kLanes) {
      V r[kRuns];
#pragma GCC unroll 4
      for (int i = 0; i < kRuns; ++i) r[i] = load_vec<V>(dst + c + kRun * i);
      hadamard_across(r);
#pragma GCC unroll 4
      for (int i = 0; i < kRuns; ++i) store_vec(dst + c + kRun * i, r[i] * norm);
    }
  }
}

// The whole blocks of kSize elements among src[0, m) into x: 16-float vectors on the
// AVX-512 path (kLanes 16) from blocks of 16, else 8-float vectors (the AVX2 and baseline
// paths, 8 registers of 8 floats; also AVX-512's blocks of 8).
template <int kLanes, int kSize>
QCOLL_INLINE void hadamard_whole(const float* src, float* x, int64_t m, float norm) {
  for (int64_t i = 0; i < m; i += kSize) {
    if constexpr (kLanes == 16 && kSize >= 16)
      hadamard_block<Vec16f, Vec16i, 16, kSize>(src + i, x + i, norm);
    else
      hadamard_block<Vec8f, Vec8i, 8, kSize>(src + i, x + i, norm);
  }
}

template <int kLanes>
QCOLL_INLINE void hadamard_blocks_as(const float* src, float* x, int64_t m, int size) {
  const int64_t whole = m - m % size;
  if (src != x) std::memcpy(x + whole, src + whole, static_cast<size_t>(m - whole) * 4);
  const float norm = math::hadamard_norm(size);
  switch (size) {
    case 8: return hadamard_whole<kLanes, 8>(src, x, whole, norm);
    case 16: return hadamard_whole<kLanes, 16>(src, x, whole, norm);
    case 32: return hadamard_whole<kLanes, 32>(src, x, whole, norm);
    case 64: return hadamard_whole<kLanes, 64>(src, x, whole, norm);
    case 128: return hadamard_whole<kLanes, 128>(src, x, whole, norm);
    default: return hadamard_whole<kLanes, 256>(src, x, whole, norm);  // kMaxHadamardSize
  }
}
static_assert(kMaxHadamardSize == 256, "hadamard_blocks_as has a case per size");

// Hadamard smoothing (quant_math.h) of the whole blocks of `size` elements among src[0, m),
// into x (which may be src). src starts on a block boundary of its run, and m is a multiple
// of size except at the run's end, whose partial block is copied untransformed. The
// non-finite values an overflowing sum may produce are left to the callers' stores, which
// canonicalize NaN. Out of line, one per ISA path (a call per piece of up to 2048 elements):
// the register-resident form needs AVX-512's 32 registers, so the drivers' own ISA
// variants cannot share one inlined body.
QCOLL_TARGET_AVX512 inline __attribute__((noinline)) void hadamard_blocks_avx512(
    const float* src, float* x, int64_t m, int size) {
  hadamard_blocks_as<16>(src, x, m, size);
}
QCOLL_TARGET_AVX2 inline __attribute__((noinline)) void hadamard_blocks_avx2(
    const float* src, float* x, int64_t m, int size) {
  hadamard_blocks_as<8>(src, x, m, size);
}
inline __attribute__((noinline)) void hadamard_blocks_baseline(const float* src, float* x,
                                                                int64_t m, int size) {
  hadamard_blocks_as<8>(src, x, m, size);
}
inline void hadamard_blocks(const float* src, float* x, int64_t m, int size) {
  switch (active_isa()) {
    case Isa::kAvx512: return hadamard_blocks_avx512(src, x, m, size);
    case Isa::kAvx2: return hadamard_blocks_avx2(src, x, m, size);
    default: return hadamard_blocks_baseline(src, x, m, size);
  }
}

QCOLL_INLINE void hadamard_blocks(float* x, int64_t m, int size) { hadamard_blocks(x, x, m, size); }

// The transformed copy of m values in buf (which x may be already): buf itself.
QCOLL_INLINE float* hadamard_into(const float* x, int64_t m, int size, float* buf) {
  hadamard_blocks(x, buf, m, size);
  return buf;
}

// Runs body(i0, i1) over contiguous ranges of [0, items), one per OpenMP thread.
template <typename Body>
void for_group_ranges(int64_t items, bool parallel, Body body) {
#pragma omp parallel if (parallel)
  {
    int64_t t = 0, nt = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int64_t per = (items + nt - 1) / nt;
    const int64_t i0 = std::min(items, t * per);
    body(i0, std::min(items, i0 + per));
  }
}

}  // namespace cpu
}  // namespace qcoll
