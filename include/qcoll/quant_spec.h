// What a block-quantized tensor is: the parameters of the code and the byte layout.
//
// Layout of a quantized run of n elements (x.reshape(-1) order):
//   codes   : ceil(n * code_bits(format) / 8) bytes. int8: one signed (symmetric) or
//             unsigned (asymmetric) byte per element. int4: two codes per byte, element 2k
//             in the low nibble, 2k+1 in the high nibble. fp8_e4m3: one OCP FP8 E4M3FN byte
//             per element (symmetric only).
//   scales  : one float32 per group of `group_size` consecutive elements (the last group
//             may be shorter), ceil(n / group_size) of them.
//   offsets : asymmetric only, one float32 per group (the group minimum).
// Because group_size is a multiple of 8, every group starts on a whole byte for every
// format.
#pragma once

#include <cstdint>
#include <type_traits>

// The format helpers below are also evaluated in device code (the kernel templates).
#if defined(__CUDACC__)
#define QCOLL_SPEC_HD __host__ __device__
#else
#define QCOLL_SPEC_HD
#endif

namespace qcoll {

enum class Rounding : int32_t {
  kNearest = 0,     // round half to even
  kStochastic = 1,  // floor(v + u), u from a counter-based generator keyed by (seed, index)
};

// The code format is THE switch of every kernel, plan and binding: what a code is and how
// many bits it takes come from here (and the per-value math in quant_math.h), never from a
// bit count. The codes are part of the binding ABI (exported as _C.FORMATS); never renumber.
enum class CodeFormat : int32_t {
  kInt8 = 0,
  kInt4 = 1,
  kFp8E4M3 = 2,  // OCP FP8 E4M3FN: bias 7, max 448, no Inf, NaN = S.1111.111
  // Wire chunks only: no codes, the values travel in their own dtype (Python: None).
  kRaw = 3,
};

inline constexpr bool format_valid(int32_t code) { return code >= 0 && code <= 2; }
inline constexpr bool wire_format_valid(int32_t code) { return code >= 0 && code <= 3; }

// Bits per code (0 for raw chunks).
QCOLL_SPEC_HD inline constexpr int32_t code_bits(CodeFormat f) {
  return f == CodeFormat::kInt4 ? 4 : f == CodeFormat::kRaw ? 0 : 8;
}

// Codes are scaled floating-point values (no asymmetric variant), not integers.
QCOLL_SPEC_HD inline constexpr bool format_is_float(CodeFormat f) { return f == CodeFormat::kFp8E4M3; }

// The one dispatch from a format value to kernel code: calls
// f(std::integral_constant<CodeFormat, format>) for a code format (callers validated it;
// kRaw never reaches a code kernel).
// Forced inline on GCC/Clang: the CPU kernels call it inside their ISA-specific drivers,
// and an out-of-line copy would run the element loops it selects at the baseline ISA.
#if defined(__GNUC__)
#define QCOLL_FORCE_INLINE inline __attribute__((always_inline))
#else
#define QCOLL_FORCE_INLINE inline
#endif
template <typename F>
QCOLL_FORCE_INLINE void with_format(CodeFormat format, F&& f) {
  switch (format) {
    case CodeFormat::kInt4: return f(std::integral_constant<CodeFormat, CodeFormat::kInt4>{});
    case CodeFormat::kFp8E4M3: return f(std::integral_constant<CodeFormat, CodeFormat::kFp8E4M3>{});
    default: return f(std::integral_constant<CodeFormat, CodeFormat::kInt8>{});
  }
}

inline const char* format_name(CodeFormat f) {
  switch (f) {
    case CodeFormat::kInt8: return "int8";
    case CodeFormat::kInt4: return "int4";
    case CodeFormat::kFp8E4M3: return "fp8_e4m3";
    case CodeFormat::kRaw: return "raw";
  }
  return "unknown";
}

inline constexpr int64_t kGroupSizeMultiple = 8;
inline constexpr int64_t kMaxGroupSize = int64_t{1} << 24;
// Hadamard smoothing: blocks of a power of two in [kMinHadamardSize, kMaxHadamardSize]
// elements that divides the group size (quant_math.h: hadamard_*). Whole packets of 8 at
// least; at most 32 packets, so a block's exchanges stay inside one CUDA warp.
inline constexpr int64_t kMinHadamardSize = 8;
inline constexpr int64_t kMaxHadamardSize = 256;

struct QuantSpec {
  CodeFormat format = CodeFormat::kInt8;
  int64_t group_size = 256;
  bool symmetric = true;
  Rounding rounding = Rounding::kNearest;
  uint64_t seed = 0;  // used by stochastic rounding only
  int32_t hadamard_size = 0;  // 0: off; else the codes are of the Hadamard-transformed values
};

inline constexpr int64_t num_groups(int64_t n, int64_t group_size) {
  return (n + group_size - 1) / group_size;
}

QCOLL_SPEC_HD inline constexpr int64_t code_bytes(int64_t n, CodeFormat f) {
  return (n * code_bits(f) + 7) / 8;
}

// Throws ArgumentError naming the offending field; used by every entry point.
void validate(const QuantSpec& spec);
// hadamard_size is 0, or a power of two in [kMinHadamardSize, kMaxHadamardSize] dividing
// group_size (ArgumentError otherwise).
void validate_hadamard(int64_t hadamard_size, int64_t group_size);

}  // namespace qcoll
