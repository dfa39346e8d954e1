// The per-chunk loops of the CPU kernels (quantize.cpp, wire.cpp): stats, nearest codes
// and decoding of runs of fp32 values, plus the OpenMP range splitter. All helpers are
// forced inline so that each ISA-cloned range driver compiles them for its own ISA.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu/convert.h"
#include "qcoll/quant_math.h"

// The per-range drivers are compiled for x86-64-v4 (AVX-512) and v3 (AVX2, F16C) as well
// and picked at load time; the per-group helpers are forced inline into them so every
// loop gets the wider ISA without a call per group. Every variant does the same IEEE
// operations (no FMA: -ffp-contract=off), so results stay bit-identical.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QCOLL_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QCOLL_CPU_CLONES
#endif
#define QCOLL_INLINE inline __attribute__((always_inline))

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
QCOLL_INLINE void accumulate_stats(const float* x, int64_t m, bool symmetric, math::GroupStats& s) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(x);
  uint32_t abs_bits = s.abs_bits;
  if (symmetric) {
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

// Nearest-rounded codes of m values straight into packed bytes; branch-free so it
// vectorizes (the group's scale is > 0 here).
template <bool kSym, CodeFormat kF>
QCOLL_INLINE void code_nearest(const float* x, int64_t m, const math::GroupParams& p, uint8_t* out) {
  const math::GroupParams params = p;  // a local copy: byte stores cannot alias it
  auto code = [params](float v) { return math::encode_scaled<kSym>(v, params, kF, false, 0.0f); };
  if constexpr (code_bits(kF) == 8) {
    for (int64_t i = 0; i < m; ++i) out[i] = code(x[i]);
    return;
  }
  const int64_t pairs = m / 2;
  for (int64_t i = 0; i < pairs; ++i)
    out[i] = static_cast<uint8_t>(code(x[2 * i]) | (code(x[2 * i + 1]) << 4));
  if (m & 1) out[pairs] = code(x[m - 1]);  // odd tail: high nibble 0
}

// The counter-based hash does not vectorize; stochastic codes go one value at a time.
inline void code_stochastic(const float* x, int64_t m, const math::GroupParams& p,
                            CodeFormat format, bool symmetric, uint64_t key, uint64_t index0,
                            uint8_t* out) {
  for (int64_t i = 0; i < m; ++i) {
    const float u = math::uniform01(key, index0 + static_cast<uint64_t>(i));
    const uint8_t c = math::encode_value(x[i], p, format, symmetric, true, u);
    if (code_bits(format) == 8) out[i] = c;
    else out[i / 2] = (i & 1) ? static_cast<uint8_t>(out[i / 2] | (c << 4)) : c;
  }
}

// Codes of m values of a group (index0: the stochastic-rounding index of x[0]); reads no
// values when the group's codes are all zero.
QCOLL_INLINE void code_piece(const float* x, int64_t m, const math::GroupParams& p,
                                   CodeFormat format, bool symmetric, bool stochastic,
                                   uint64_t key, uint64_t index0, uint8_t* out) {
  if (math::codes_are_zero(p)) {
    std::memset(out, 0, static_cast<size_t>(code_bytes(m, format)));
  } else if (stochastic) {
    code_stochastic(x, m, p, format, symmetric, key, index0, out);
  } else {
    with_format(format, [&](auto f) {
      constexpr CodeFormat kF = decltype(f)::value;
      if (symmetric) code_nearest<true, kF>(x, m, p, out);
      else if constexpr (!format_is_float(kF)) code_nearest<false, kF>(x, m, p, out);
    });
  }
}

// The group encoder of the CPU quantize and wire kernels (bit-identity in one place): a
// group of m elements whose fp32 values values(c, k) gives piecewise (elements [c, c + k),
// c a multiple of `piece`, k <= piece). Pass 1 gathers the statistics over the pieces;
// pass 2 calls code(x, c, k, params) for the codes. A group of one piece keeps its values
// from pass 1, and so does a group whose codes are all zero (coded whole, values unread);
// larger groups recompute each piece. Returns the group's parameters. The callers' lambdas
// are always_inline, so the ISA clones of their range drivers vectorize them too.
template <typename Values, typename Code>
QCOLL_INLINE math::GroupParams encode_group(int64_t m, int64_t piece, CodeFormat format,
                                            bool symmetric, const Values& values,
                                            const Code& code) {
  math::GroupStats stats = math::stats_identity();
  const float* x = nullptr;
  for (int64_t c = 0; c < m; c += piece) {
    const int64_t k = std::min(piece, m - c);
    x = values(c, k);
    accumulate_stats(x, k, symmetric, stats);
  }
  const math::GroupParams p = math::group_params(stats, format, symmetric);
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

// Values of m codes into fp32 (the output buffer itself when the output is fp32).
// The value of every fp8_e4m3 byte (math::fp8_e4m3_decode, computed once), so the CPU
// decode loops are a load and a multiply: the bit assembly does not vectorize.
inline const float* fp8_e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = math::fp8_e4m3_decode(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// value(b): math::decode_value(b, p, kF, sym), with fp8 (symmetric only) through the table.
template <CodeFormat kF>
QCOLL_INLINE auto code_values(const math::GroupParams& p, bool sym) {
  if constexpr (kF == CodeFormat::kFp8E4M3) {
    const float* table = fp8_e4m3_values();
    return [p, table](uint8_t b) { return math::mul(table[b], p.scale); };
  } else {
    return [p, sym](uint8_t b) { return math::decode_value(b, p, kF, sym); };
  }
}

template <CodeFormat kF>
QCOLL_INLINE void decode_chunk_as(const uint8_t* in, int64_t m, const math::GroupParams& p, bool sym,
                                  float* out) {
  const auto value = code_values<kF>(p, sym);
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
}

QCOLL_INLINE void decode_chunk(const uint8_t* in, int64_t m, const math::GroupParams& p,
                               CodeFormat format, bool sym, float* out) {
  with_format(format, [&](auto f) { decode_chunk_as<decltype(f)::value>(in, m, p, sym, out); });
}

// Hadamard smoothing (quant_math.h) of the whole blocks of `size` elements among x[0, m), in
// place. x starts on a block boundary of its run, and m is a multiple of size except at the
// run's end, whose partial block stays untransformed. The non-finite values an overflowing
// sum may produce are left to the callers' stores, which canonicalize NaN.
QCOLL_INLINE void hadamard_blocks(float* x, int64_t m, int size) {
  m -= m % size;
  for (int64_t i = 0; i < m; i += 8) math::hadamard8(x + i);
  for (int64_t s = 8; s < size; s *= 2)
    for (int64_t b = 0; b < m; b += 2 * s)
      for (int64_t i = b; i < b + s; ++i) {
        const float lo = x[i], hi = x[i + s];
        x[i] = math::add(lo, hi);
        x[i + s] = math::sub(lo, hi);
      }
  const float norm = math::hadamard_norm(size);
  for (int64_t i = 0; i < m; ++i) x[i] = math::mul(x[i], norm);
}

// The transformed copy of m values in buf (which x may be already): buf itself.
QCOLL_INLINE float* hadamard_into(const float* x, int64_t m, int size, float* buf) {
  if (x != buf) std::memcpy(buf, x, static_cast<size_t>(m) * 4);
  hadamard_blocks(buf, m, size);
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
