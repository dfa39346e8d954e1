// CPU block quantize / dequantize. Each group is processed in pieces of kGroupPiece elements
// (converted to fp32 in a stack buffer unless already fp32) by the group encoder of
// quant_loops.h: pass 1 gathers the group's statistics, pass 2 codes it (from the same
// piece, still in L1, for groups of up to kGroupPiece elements). Groups are independent, so
// OpenMP gives each thread one contiguous range of groups; each range runs the ISA variant
// of its driver (cpu/isa.h), specialised once per call on dtype, format and symmetry.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/convert.h"
#include "cpu/cpu_kernels.h"
#include "cpu/quant_loops.h"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cpu {
namespace {

// A piece of a group converted at once (not a wire chunk): multiple of 8, so int4 pieces
// start on whole bytes.
constexpr int64_t kGroupPiece = 1024;
static_assert(kGroupPiece % kMaxHadamardSize == 0, "pieces hold whole Hadamard blocks");

template <DType kT, CodeFormat kF, bool kSym>
QCOLL_INLINE void quantize_group(const QuantizeArgs& a, int64_t g, uint64_t key, float* buf) {
  const QuantSpec& spec = a.spec;
  constexpr int64_t esize = static_cast<int64_t>(dtype_size(kT));
  const int64_t begin = g * spec.group_size;
  const int64_t len = std::min(spec.group_size, a.n - begin);
  const char* src = static_cast<const char*>(a.input) + begin * esize;

  // The values of elements [c, c + m) of the group: Hadamard-transformed in buf when asked
  // (pieces start on block boundaries: kGroupPiece is a multiple of kMaxHadamardSize).
  const int hadamard = spec.hadamard_size;
  const auto values = [&](int64_t c, int64_t m) QCOLL_LAMBDA {
    const float* x = as_float(src + c * esize, kT, m, buf);
    return hadamard ? hadamard_into(x, m, hadamard, buf) : x;
  };
  const bool stochastic = spec.rounding == Rounding::kStochastic;
  const math::GroupParams p = encode_group<kF, kSym>(
      len, kGroupPiece, values,
      [&](const float* x, int64_t c, int64_t m,
          const math::GroupParams& q) QCOLL_LAMBDA {
        code_piece<kF, kSym>(x, m, q, stochastic, key,
                             a.index_base + static_cast<uint64_t>(begin + c),
                             a.codes + code_bytes(begin + c, kF));
      });
  a.scales[g] = p.scale;
  if (!kSym) a.offsets[g] = p.offset;
}

template <DType kT, CodeFormat kF>
QCOLL_INLINE void dequantize_group(const DequantizeArgs& a, int64_t g, bool sym, float* buf) {
  constexpr int64_t esize = static_cast<int64_t>(dtype_size(kT));
  const int64_t begin = g * a.group_size;
  const int64_t len = std::min(a.group_size, a.n - begin);
  const math::GroupParams p{a.scales[g], sym ? 0.0f : a.offsets[g]};
  char* dst = static_cast<char*>(a.output) + begin * esize;

  for (int64_t c = 0; c < len; c += kGroupPiece) {
    const int64_t m = std::min(kGroupPiece, len - c);
    const uint8_t* in = a.codes + code_bytes(begin + c, kF);
    if constexpr (kT == DType::kFloat32) {
      float* out = reinterpret_cast<float*>(dst + c * esize);
      decode_chunk_as<kF>(in, m, p, sym, out);
      if (a.hadamard_size) hadamard_blocks(out, m, a.hadamard_size);  // the inverse
      // A non-finite group's NaN scale (or offset) makes every value NaN, and an overflowing
      // inverse transform may make some: store CUDA's canonical NaN, as store_from_float
      // does for the other dtypes.
      if (!math::is_finite(p.scale) || !math::is_finite(p.offset) || a.hadamard_size)
        store_from_float(out, DType::kFloat32, m, out);
    } else {
      decode_chunk_as<kF>(in, m, p, sym, buf);
      if (a.hadamard_size) hadamard_blocks(buf, m, a.hadamard_size);
      store_from_float(buf, kT, m, dst + c * esize);
    }
  }
}

QCOLL_INLINE void quantize_range(const QuantizeArgs& a, int64_t g0, int64_t g1, uint64_t key) {
  alignas(64) float buf[kGroupPiece];
  with_float_dtype(a.dtype, [&](auto t) QCOLL_LAMBDA {
    with_format(a.spec.format, [&](auto f) QCOLL_LAMBDA {
      constexpr DType kT = decltype(t)::value;
      constexpr CodeFormat kF = decltype(f)::value;
      if (a.spec.symmetric) {
        for (int64_t g = g0; g < g1; ++g) quantize_group<kT, kF, true>(a, g, key, buf);
      } else if constexpr (!format_is_float(kF)) {
        for (int64_t g = g0; g < g1; ++g) quantize_group<kT, kF, false>(a, g, key, buf);
      }
    });
  });
}

QCOLL_INLINE void dequantize_range(const DequantizeArgs& a, int64_t g0, int64_t g1) {
  alignas(64) float buf[kGroupPiece];
  with_float_dtype(a.dtype, [&](auto t) QCOLL_LAMBDA {
    with_format(a.format, [&](auto f) QCOLL_LAMBDA {
      for (int64_t g = g0; g < g1; ++g)
        dequantize_group<decltype(t)::value, decltype(f)::value>(a, g, a.symmetric, buf);
    });
  });
}

QCOLL_ISA_VARIANTS(quantize_groups, quantize_range,
                   (const QuantizeArgs& a, int64_t g0, int64_t g1, uint64_t key), (a, g0, g1, key))
QCOLL_ISA_VARIANTS(dequantize_groups, dequantize_range,
                   (const DequantizeArgs& a, int64_t g0, int64_t g1), (a, g0, g1))

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
