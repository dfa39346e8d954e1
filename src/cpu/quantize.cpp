// CPU block quantize / dequantize. Each group is processed in chunks of kChunk elements
// (converted to fp32 in a stack buffer unless already fp32): pass 1 gathers the group's
// statistics, pass 2 codes it. Groups are independent, so OpenMP gives each thread one
// contiguous range of groups.
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu/convert.h"
#include "cpu/cpu_kernels.h"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cpu {
namespace {

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

constexpr int64_t kChunk = 1024;  // multiple of 8, so int4 chunks start on whole bytes
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
template <bool kSym, int kBits>
QCOLL_INLINE void code_nearest(const float* x, int64_t m, const math::GroupParams& p, uint8_t* out) {
  const math::GroupParams params = p;  // a local copy: byte stores cannot alias it
  auto code = [params](float v) {
    return math::code_to_bits(math::quantize_scaled<kSym>(v, params, kBits, false, 0.0f), kBits);
  };
  if constexpr (kBits == 8) {
    for (int64_t i = 0; i < m; ++i) out[i] = code(x[i]);
    return;
  }
  const int64_t pairs = m / 2;
  for (int64_t i = 0; i < pairs; ++i)
    out[i] = static_cast<uint8_t>(code(x[2 * i]) | (code(x[2 * i + 1]) << 4));
  if (m & 1) out[pairs] = code(x[m - 1]);  // odd tail: high nibble 0
}

// The counter-based hash does not vectorize; stochastic codes go one value at a time.
void code_stochastic(const float* x, int64_t m, const math::GroupParams& p, const QuantSpec& spec,
                     uint64_t key, uint64_t index0, uint8_t* out) {
  for (int64_t i = 0; i < m; ++i) {
    const float u = math::uniform01(key, index0 + static_cast<uint64_t>(i));
    const uint8_t c =
        math::code_to_bits(math::quantize_value(x[i], p, spec.bits, spec.symmetric, true, u), spec.bits);
    if (spec.bits == 8) out[i] = c;
    else out[i / 2] = (i & 1) ? static_cast<uint8_t>(out[i / 2] | (c << 4)) : c;
  }
}

QCOLL_INLINE void code_chunk(const float* x, int64_t m, const math::GroupParams& p, const QuantSpec& spec,
                uint64_t key, uint64_t index0, uint8_t* out) {
  if (math::codes_are_zero(p)) {
    std::memset(out, 0, static_cast<size_t>(code_bytes(m, spec.bits)));
  } else if (spec.rounding == Rounding::kStochastic) {
    code_stochastic(x, m, p, spec, key, index0, out);
  } else if (spec.symmetric) {
    spec.bits == 8 ? code_nearest<true, 8>(x, m, p, out) : code_nearest<true, 4>(x, m, p, out);
  } else {
    spec.bits == 8 ? code_nearest<false, 8>(x, m, p, out) : code_nearest<false, 4>(x, m, p, out);
  }
}

QCOLL_INLINE void quantize_group(const QuantizeArgs& a, int64_t g, uint64_t key) {
  alignas(64) float buf[kChunk];
  const QuantSpec& spec = a.spec;
  const size_t esize = dtype_size(a.dtype);
  const int64_t begin = g * spec.group_size;
  const int64_t len = std::min(spec.group_size, a.n - begin);
  const char* src = static_cast<const char*>(a.input) + begin * esize;

  math::GroupStats stats = math::stats_identity();
  for (int64_t c = 0; c < len; c += kChunk) {
    const int64_t m = std::min(kChunk, len - c);
    accumulate_stats(as_float(src + c * esize, a.dtype, m, buf), m, spec.symmetric, stats);
  }
  const math::GroupParams p = math::group_params(stats, spec.bits, spec.symmetric);
  a.scales[g] = p.scale;
  if (!spec.symmetric) a.offsets[g] = p.offset;

  for (int64_t c = 0; c < len; c += kChunk) {
    const int64_t m = std::min(kChunk, len - c);
    code_chunk(as_float(src + c * esize, a.dtype, m, buf), m, p, spec, key,
               a.index_base + static_cast<uint64_t>(begin + c),
               a.codes + code_bytes(begin + c, spec.bits));
  }
}

// Values of m codes into fp32 (the output buffer itself when the output is fp32).
QCOLL_INLINE void decode_chunk(const uint8_t* in, int64_t m, const math::GroupParams& p, int bits, bool sym,
                  float* out) {
  if (bits == 8) {
    for (int64_t i = 0; i < m; ++i)
      out[i] = math::dequantize_value(math::bits_to_code(in[i], 8, sym), p, sym);
    return;
  }
  const int64_t pairs = m / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    out[2 * i] = math::dequantize_value(math::bits_to_code(in[i], 4, sym), p, sym);
    out[2 * i + 1] = math::dequantize_value(math::bits_to_code(in[i] >> 4, 4, sym), p, sym);
  }
  if (m & 1) out[m - 1] = math::dequantize_value(math::bits_to_code(in[pairs], 4, sym), p, sym);
}

QCOLL_INLINE void dequantize_group(const DequantizeArgs& a, int64_t g) {
  alignas(64) float buf[kChunk];
  const size_t esize = dtype_size(a.dtype);
  const int64_t begin = g * a.group_size;
  const int64_t len = std::min(a.group_size, a.n - begin);
  const math::GroupParams p{a.scales[g], a.symmetric ? 0.0f : a.offsets[g]};
  char* dst = static_cast<char*>(a.output) + begin * esize;

  for (int64_t c = 0; c < len; c += kChunk) {
    const int64_t m = std::min(kChunk, len - c);
    const uint8_t* in = a.codes + code_bytes(begin + c, a.bits);
    if (a.dtype == DType::kFloat32) {
      decode_chunk(in, m, p, a.bits, a.symmetric, reinterpret_cast<float*>(dst + c * esize));
    } else {
      decode_chunk(in, m, p, a.bits, a.symmetric, buf);
      store_from_float(buf, a.dtype, m, dst + c * esize);
    }
  }
}

QCOLL_CPU_CLONES
void quantize_groups(const QuantizeArgs& a, int64_t g0, int64_t g1, uint64_t key) {
  for (int64_t g = g0; g < g1; ++g) quantize_group(a, g, key);
}

QCOLL_CPU_CLONES
void dequantize_groups(const DequantizeArgs& a, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) dequantize_group(a, g);
}

// Runs body(g0, g1) over contiguous ranges of [0, groups), one per OpenMP thread.
template <typename Body>
void for_group_ranges(int64_t groups, bool parallel, Body body) {
#pragma omp parallel if (parallel)
  {
    int64_t t = 0, nt = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int64_t per = (groups + nt - 1) / nt;
    const int64_t g0 = std::min(groups, t * per);
    body(g0, std::min(groups, g0 + per));
  }
}

}  // namespace

void quantize(const QuantizeArgs& a) {
  const uint64_t key = math::rng_key(a.spec.seed);
  for_group_ranges(num_groups(a.n, a.spec.group_size), a.n >= kParallelThreshold,
                   [&](int64_t g0, int64_t g1) { quantize_groups(a, g0, g1, key); });
}

void dequantize(const DequantizeArgs& a) {
  for_group_ranges(num_groups(a.n, a.group_size), a.n >= kParallelThreshold,
                   [&](int64_t g0, int64_t g1) { dequantize_groups(a, g0, g1); });
}

}  // namespace cpu
}  // namespace qcoll
