// What a block-quantized tensor is: the parameters of the code and the byte layout.
//
// Layout of a quantized run of n elements (x.reshape(-1) order):
//   codes   : ceil(n * bits / 8) bytes. int8: one signed (symmetric) or unsigned
//             (asymmetric) byte per element. int4: two codes per byte, element 2k in the
//             low nibble, 2k+1 in the high nibble.
//   scales  : one float32 per group of `group_size` consecutive elements (the last group
//             may be shorter), ceil(n / group_size) of them.
//   offsets : asymmetric only, one float32 per group (the group minimum).
// Because group_size is a multiple of 8, every group starts on a whole byte for both
// widths. A future fp8 (e4m3) code keeps this layout: one byte per element, one fp32 scale
// per group; it gets its own CodeFormat value.
#pragma once

#include <cstdint>

namespace qcoll {

enum class Rounding : int32_t {
  kNearest = 0,     // round half to even
  kStochastic = 1,  // floor(v + u), u from a counter-based generator keyed by (seed, index)
};

enum class CodeFormat : int32_t {
  kInt8 = 0,
  kInt4 = 1,
  // kFp8E4M3 = 2 is reserved for the fp8 variant.
};

inline constexpr int64_t kGroupSizeMultiple = 8;
inline constexpr int64_t kMaxGroupSize = int64_t{1} << 24;
// Hadamard smoothing: blocks of a power of two in [kMinHadamardSize, kMaxHadamardSize]
// elements that divides the group size (quant_math.h: hadamard_*). Whole packets of 8 at
// least; at most 32 packets, so a block's exchanges stay inside one CUDA warp.
inline constexpr int64_t kMinHadamardSize = 8;
inline constexpr int64_t kMaxHadamardSize = 256;

struct QuantSpec {
  int32_t bits = 8;  // 4 or 8
  int64_t group_size = 256;
  bool symmetric = true;
  Rounding rounding = Rounding::kNearest;
  uint64_t seed = 0;  // used by stochastic rounding only
  int32_t hadamard_size = 0;  // 0: off; else the codes are of the Hadamard-transformed values
};

inline constexpr int64_t num_groups(int64_t n, int64_t group_size) {
  return (n + group_size - 1) / group_size;
}

inline constexpr int64_t code_bytes(int64_t n, int32_t bits) {
  return (n * bits + 7) / 8;
}

// Throws ArgumentError naming the offending field; used by every entry point.
void validate(const QuantSpec& spec);
// hadamard_size is 0, or a power of two in [kMinHadamardSize, kMaxHadamardSize] dividing
// group_size (ArgumentError otherwise).
void validate_hadamard(int64_t hadamard_size, int64_t group_size);

}  // namespace qcoll
