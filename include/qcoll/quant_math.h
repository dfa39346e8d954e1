// The arithmetic of block quantization, shared verbatim by the CPU and CUDA kernels so
// that nearest rounding is bit-identical on both. Every multiply/add goes through mul()/
// add() so that no compiler fuses them into an FMA (the CPU build also uses
// -ffp-contract=off); divisions are IEEE-correct on both sides (no fast-math anywhere).
#pragma once

#include <cstdint>
#include <cstring>

#include "qcoll/quant_spec.h"

#if defined(__CUDACC__)
#define QCOLL_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#elif defined(__GNUC__)
// Forced inline on the host: a helper GCC leaves out of line (it did for fp8_e4m3_encode in
// one driver) is compiled once, for baseline x86-64, and runs one element per call.
#define QCOLL_HD inline __attribute__((always_inline))
#else
#define QCOLL_HD inline
#endif

namespace qcoll {
namespace math {

QCOLL_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

QCOLL_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

QCOLL_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

QCOLL_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

QCOLL_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

QCOLL_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Division by a reduction's divisor (the number of ranks, for an average). When the divisor
// is a power of two its inverse is exact, and x * (1 / d) is then the correctly rounded x / d
// bit for bit (subnormal quotients and non-finite x included), at a fraction of a divide's
// cost: on AVX-512 the vector divide took a quarter of the CPU's fused dequantize-reduce.
struct Divisor {
  float value;
  float exact_inverse;  // 1 / value when that is exact (value a power of two), else 0
};

QCOLL_HD Divisor make_divisor(float d) {
  const uint32_t u = float_bits(d);
  const uint32_t exponent = u & 0x7f800000u;
  const bool power_of_two = (u & 0x007fffffu) == 0 && exponent != 0 && exponent != 0x7f800000u;
  return Divisor{d, power_of_two ? div(1.0f, d) : 0.0f};
}

QCOLL_HD float divide(float x, const Divisor& d) {
  return d.exact_inverse != 0.0f ? mul(x, d.exact_inverse) : div(x, d.value);
}

// Exponent field all ones means Inf or NaN; tested on the bits so no compiler option
// (-ffinite-math-only) or vectorizer can fold it away.
QCOLL_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

QCOLL_HD float quiet_nan() { return bits_float(0x7fc00000u); }

// The bits of a computed fp32 value as stored by the kernels: any NaN becomes CUDA's
// canonical 0x7fffffff (what GPU arithmetic produces; x86 keeps the operand's payload and
// sign), so CPU and CUDA outputs carry the same bytes. Raw copies keep their payload.
QCOLL_HD uint32_t float_to_fp32_bits(float f) {
  const uint32_t u = float_bits(f);
  return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fffffffu : u;
}

// Round half to even for |v| < 2^22 (codes are at most 255 in magnitude). Adding and
// subtracting 1.5 * 2^23 rounds in the FPU's default mode (nearest-even) on any ISA and
// vectorizes with plain SSE2; on the GPU rintf is one instruction with the same result.
QCOLL_HD float round_half_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (v + magic) - magic;  // not folded: the build never enables fast-math
#endif
}

QCOLL_HD float floor_f(float v) {
#if defined(__CUDA_ARCH__)
  return floorf(v);
#else
  return __builtin_floorf(v);
#endif
}

QCOLL_HD float clampf(float v, float lo, float hi) {
  v = v < lo ? lo : v;  // two plain selects: the vectorizer turns each into max/min
  return v > hi ? hi : v;
}

// ---- counter-based random numbers for stochastic rounding ---------------------------
// The index-th output of SplitMix64 started from `key`: a pure function of (key, index),
// so any partition of the tensor over threads, blocks or devices draws the same bits.
QCOLL_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The key is derived from the user's seed once per call (host side).
QCOLL_HD uint64_t rng_key(uint64_t seed) { return mix64(seed ^ 0x5851f42d4c957f2dull); }

// Uniform in [0, 1) with 24 random bits (exact in fp32).
QCOLL_HD float uniform01(uint64_t key, uint64_t index) {
  const uint64_t z = mix64(key + (index + 1) * 0x9e3779b97f4a7c15ull);
  // z >> 40 < 2^24: the signed conversion is exact and vectorizes on the CPU.
  return static_cast<float>(static_cast<int32_t>(z >> 40)) * (1.0f / 16777216.0f);
}

// ---- per-group parameters --------------------------------------------------------------
struct GroupParams {
  float scale;   // 0 for an all-equal (e.g. all-zero) group, NaN for a non-finite group
  float offset;  // asymmetric: group minimum (NaN for a non-finite group); symmetric: 0
};

// ---- the code formats (quant_spec.h): the largest code magnitude, and the one-value
// encode/decode of fp8 -------------------------------------------------------------------
QCOLL_HD float qmax_symmetric(CodeFormat f) {
  return f == CodeFormat::kFp8E4M3 ? 448.0f : f == CodeFormat::kInt4 ? 7.0f : 127.0f;
}
QCOLL_HD float levels_asymmetric(CodeFormat f) { return f == CodeFormat::kInt4 ? 15.0f : 255.0f; }

// OCP FP8 E4M3FN byte of v, round half to even, saturating to +-448 (Inf included: the
// "satfinite" conversion), NaN to S.1111.111. Integer arithmetic on the float's bits only,
// so CPU and GPU agree bit for bit, and branch-free selects the CPU loops vectorize (a
// float operation under a select would stop that: it may trap).
QCOLL_HD uint8_t fp8_e4m3_encode(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal (|v| >= 2^-6): keep 3 mantissa bits, rounding the 20 dropped ones to even; a
  // carry moves into the exponent. fp32 exponent E becomes E - 127 + 7.
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal (|v| < 2^-6): |v| * 2^9 (exact: a power of two, no overflow) rounded half to
  // even, 0 to 8; 8 * 2^-9 rounds up into the smallest normal, whose byte is 0x08 as well.
  // Other magnitudes are replaced by 0 first, so the conversion is always in range.
  const bool is_sub = a < 0x3c800000u;
  const float sub_scaled = mul(bits_float(is_sub ? a : 0u), 512.0f);
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(round_half_even(sub_scaled)));
  uint32_t m = is_sub ? subnormal : normal;
  m = a >= 0x43e00000u ? 0x7eu : m;  // |v| >= 448 (Inf too): 448
  m = a > 0x7f800000u ? 0x7fu : m;   // NaN
  return static_cast<uint8_t>(sign | m);
}

// The exact value of an E4M3FN byte; NaN bytes give the canonical NaN (0x7fffffff, what
// GPU arithmetic yields), so CPU and CUDA store the same bits. Each case is picked by a test
// of the byte's low 7 bits (exponent and mantissa), which the CPU loops vectorize into few
// instructions.
QCOLL_HD float fp8_e4m3_decode(uint8_t b) {
  const uint32_t low = b & 0x7fu;
  // Normal (exponent >= 1): both fields moved into fp32's place, the exponent rebiased
  // from 7 to 127. Subnormal (low = the mantissa m): m * 2^-9, exact.
  const uint32_t normal = (low << 20) + (120u << 23);
  const uint32_t subnormal = float_bits(mul(static_cast<float>(low), 0.001953125f));
  const uint32_t mag = low >= 8u ? normal : subnormal;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  return bits_float(low == 0x7fu ? 0x7fffffffu : (sign | mag));
}

// Stochastic rounding onto the E4M3 grid: v = k * ulp + r with ulp the spacing at |v|
// (2^-9 below 2^-6); rounds up with probability r / ulp, so E[code] = v. Powers of two
// make every step exact except the add of u (as for the integer codes): v / ulp is v times
// 1 / ulp (2^-5 to 2^9, a power of two too), the same value without a division.
QCOLL_HD uint8_t fp8_e4m3_encode_stochastic(float v, float u) {
  const uint32_t a = float_bits(v) & 0x7fffffffu;
  const uint32_t e = a < 0x3c800000u ? 0x3c800000u : (a & 0x7f800000u);  // 2^max(exp,-6)
  const uint32_t ulp_bits = e - (3u << 23);
  const float ulp = bits_float(ulp_bits);
  const float inv_ulp = bits_float((254u << 23) - ulp_bits);  // exactly 1 / ulp
  // |v| <= 448 after the scale division (up to its rounding); larger values saturate.
  const float k = floor_f(add(mul(a < 0x43e00000u ? v : 0.0f, inv_ulp), u));
  return a < 0x43e00000u ? fp8_e4m3_encode(mul(k, ulp)) : fp8_e4m3_encode(v);
}

// Statistics gathered over one group, on the float's bits so every reduction is an
// integer max/min (exact, associative, vectorizable, the same on CPU and GPU):
//  - absmax: |x| as bits (sign cleared); for non-negative floats the unsigned order of the
//    bits is the numeric order, and any Inf or NaN lands at or above 0x7f800000.
//  - lo/hi: "sortable" signed keys whose int32 order is the float order.
struct GroupStats {
  uint32_t abs_bits;
  int32_t lo_key, hi_key;
};

QCOLL_HD int32_t sortable_key(uint32_t u) {
  return static_cast<int32_t>(u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) & 0x7fffffffu));
}

QCOLL_HD float key_to_float(int32_t k) {
  const uint32_t u = static_cast<uint32_t>(k);
  return bits_float(u ^ (static_cast<uint32_t>(k >> 31) & 0x7fffffffu));
}

QCOLL_HD GroupStats stats_identity() { return GroupStats{0u, INT32_MAX, INT32_MIN}; }

QCOLL_HD void stats_add(GroupStats& s, float x) {
  const uint32_t u = float_bits(x);
  const uint32_t a = u & 0x7fffffffu;
  const int32_t k = sortable_key(u);
  s.abs_bits = a > s.abs_bits ? a : s.abs_bits;
  s.lo_key = k < s.lo_key ? k : s.lo_key;
  s.hi_key = k > s.hi_key ? k : s.hi_key;
}

// The absmax statistic alone: all that a symmetric group's parameters read (group_params).
QCOLL_HD void stats_add_abs(GroupStats& s, float x) {
  const uint32_t a = float_bits(x) & 0x7fffffffu;
  s.abs_bits = a > s.abs_bits ? a : s.abs_bits;
}

QCOLL_HD GroupStats stats_combine(GroupStats a, const GroupStats& b) {
  a.abs_bits = b.abs_bits > a.abs_bits ? b.abs_bits : a.abs_bits;
  a.lo_key = b.lo_key < a.lo_key ? b.lo_key : a.lo_key;
  a.hi_key = b.hi_key > a.hi_key ? b.hi_key : a.hi_key;
  return a;
}

QCOLL_HD bool stats_finite(const GroupStats& s) { return s.abs_bits < 0x7f800000u; }

// A finite group's scale, stepped down one ulp at a time while its largest code decodes to
// an overflow (top * scale, + offset when asymmetric, as decode_value computes it). Rounding
// the division up can carry that value past FLT_MAX for a group that reaches it:
// 127 * fl(FLT_MAX / 127) is +inf. A symmetric group takes one step: it makes top * scale at
// most the absmax it was divided from (the step outweighs the quotient's rounding). An
// asymmetric group's range was rounded too, and lo is added after: some take two (FLT_MAX
// with lo 0x7ef3c447). Only groups within a step or two of FLT_MAX move; every other scale
// is the plain quotient.
QCOLL_HD float scale_with_finite_top(float scale, float top, float offset) {
  while (scale > 0.0f && !is_finite(add(mul(top, scale), offset))) scale = bits_float(float_bits(scale) - 1u);
  return scale;
}

// Every format: a non-finite group gets a NaN scale (and zero codes, codes_are_zero), so
// all of its elements decode to NaN.
QCOLL_HD GroupParams group_params(const GroupStats& s, CodeFormat f, bool symmetric) {
  if (!stats_finite(s)) return GroupParams{quiet_nan(), symmetric ? 0.0f : quiet_nan()};
  if (symmetric) {
    const float qmax = qmax_symmetric(f);
    return GroupParams{scale_with_finite_top(div(bits_float(s.abs_bits), qmax), qmax, 0.0f), 0.0f};
  }
  const float lo = key_to_float(s.lo_key);
  // A range that overflows fp32 cannot be coded; the group is marked non-finite.
  const float range = sub(key_to_float(s.hi_key), lo);
  if (!is_finite(range)) return GroupParams{quiet_nan(), quiet_nan()};
  const float levels = levels_asymmetric(f);
  return GroupParams{scale_with_finite_top(div(range, levels), levels, lo), lo};
}

// The integer code of x (as a float holding an integer), before packing, for a group whose
// scale is > 0. `u` is the stochastic-rounding draw, ignored for nearest rounding.
template <bool kSymmetric>
QCOLL_HD float quantize_scaled(float x, const GroupParams& p, CodeFormat f, bool stochastic, float u) {
  const float v = kSymmetric ? div(x, p.scale) : div(sub(x, p.offset), p.scale);
  const float q = stochastic ? floor_f(add(v, u)) : round_half_even(v);
  return kSymmetric ? clampf(q, -qmax_symmetric(f), qmax_symmetric(f))
                    : clampf(q, 0.0f, levels_asymmetric(f));
}

// Any group: scale == 0 (all-equal group, or absmax so tiny that scale underflows) and a
// NaN scale (non-finite group) both code to 0; the scale carries the information.
QCOLL_HD bool codes_are_zero(const GroupParams& p) { return !(p.scale > 0.0f); }

// ---- packing -----------------------------------------------------------------------
// Symmetric integer codes are stored two's complement (int8 byte, or 4-bit nibble);
// asymmetric codes are stored unsigned.
QCOLL_HD uint8_t code_to_bits(float q, CodeFormat f) {
  const int32_t c = static_cast<int32_t>(q);
  return f == CodeFormat::kInt4 ? static_cast<uint8_t>(c & 0x0f) : static_cast<uint8_t>(c & 0xff);
}

QCOLL_HD int32_t bits_to_code(uint8_t b, CodeFormat f, bool symmetric) {
  if (f != CodeFormat::kInt4) return symmetric ? static_cast<int32_t>(static_cast<int8_t>(b)) : b;
  const int32_t n = b & 0x0f;
  return symmetric ? (n ^ 0x8) - 0x8 : n;  // sign-extend the nibble
}

// The code bits of x (the low code_bits(f) bits) for a group whose scale is > 0.
template <bool kSymmetric>
QCOLL_HD uint8_t encode_scaled(float x, const GroupParams& p, CodeFormat f, bool stochastic, float u) {
  if (f == CodeFormat::kFp8E4M3) {  // symmetric only (validate)
    const float v = div(x, p.scale);
    return stochastic ? fp8_e4m3_encode_stochastic(v, u) : fp8_e4m3_encode(v);
  }
  return code_to_bits(quantize_scaled<kSymmetric>(x, p, f, stochastic, u), f);
}

QCOLL_HD uint8_t encode_value(float x, const GroupParams& p, CodeFormat f, bool symmetric,
                              bool stochastic, float u) {
  if (codes_are_zero(p)) return 0;
  return symmetric ? encode_scaled<true>(x, p, f, stochastic, u)
                   : encode_scaled<false>(x, p, f, stochastic, u);
}

// The value of code bits b (the low code_bits(f) bits) in a group with parameters p.
QCOLL_HD float decode_value(uint8_t b, const GroupParams& p, CodeFormat f, bool symmetric) {
  const float c = f == CodeFormat::kFp8E4M3 ? fp8_e4m3_decode(b)
                                            : static_cast<float>(bits_to_code(b, f, symmetric));
  const float y = mul(c, p.scale);
  return symmetric ? y : add(y, p.offset);
}

// ---- Hadamard smoothing -------------------------------------------------------------------
// The orthonormal Walsh-Hadamard transform of a block of `size` elements (a power of two, a
// multiple of 8): stages with element strides 1, 2, 4, ..., size / 2, each replacing the
// pair (a, b) at (i, i + stride), i & stride == 0, by (a + b, a - b); then every element
// times hadamard_norm(size). H = H^T and H H = I, so it is its own inverse. The CPU and CUDA
// kernels apply exactly these operations (hadamard8 on each packet, then the cross-packet
// stages through butterfly(), then the norm) in this stage order; each stage's results
// depend only on the previous stage's, so fp32 results are bit-identical however a stage's
// pairs are distributed over threads.

// fl(1 / sqrt(size)): a power of two times fl(1 / sqrt(2)) when log2(size) is odd (exact).
QCOLL_HD float hadamard_norm(int size) {
  float r = 1.0f;
  int k = 1;
  for (; 4 * k <= size; k *= 4) r = mul(r, 0.5f);
  return k == size ? r : mul(r, 0.70710678118654752f);
}

// One butterfly as seen from one element: the lower element of a pair (upper == false) gets
// mine + partner, the upper one partner - mine (the lower minus the upper).
QCOLL_HD float butterfly(float mine, float partner, bool upper) {
  return upper ? sub(partner, mine) : add(mine, partner);
}

// The stages with strides 1, 2 and 4, on 8 consecutive elements.
QCOLL_HD void hadamard8(float* x) {
  for (int s = 1; s < 8; s *= 2)
    for (int i = 0; i < 8; ++i)
      if (!(i & s)) {
        const float a = x[i], b = x[i + s];
        x[i] = add(a, b);
        x[i + s] = sub(a, b);
      }
}

// ---- dtype conversions (host side; device code uses the CUDA intrinsics, which round
// the same way: nearest-even, NaN stays NaN) -------------------------------------------
inline float bf16_bits_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // canonical NaN, as CUDA returns
  u += 0x7fffu + ((u >> 16) & 1u);                   // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal half: normalize
    exp = 113u;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  return bits_float(u);
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;                          // NaN (CUDA's canonical)
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to Inf
  if (a >= 0x38800000u) {                                      // normal half
    const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: value = mant * 2^-24; shift the full significand, round to even.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  const uint32_t r = q + ((rem > halfway || (rem == halfway && (q & 1u))) ? 1u : 0u);
  return static_cast<uint16_t>(sign | r);
}

}  // namespace math
}  // namespace qcoll
