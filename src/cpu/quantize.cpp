// CPU block quantize / dequantize. Each group is processed in chunks of kChunk elements
// (converted to fp32 in a stack buffer unless already fp32) by the group encoder of
// quant_loops.h: pass 1 gathers the group's statistics, pass 2 codes it. Groups are
// independent, so OpenMP gives each thread one contiguous range of groups.
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

constexpr int64_t kChunk = 1024;  // multiple of 8, so int4 chunks start on whole bytes
static_assert(kChunk % kMaxHadamardSize == 0, "chunks hold whole Hadamard blocks");
QCOLL_INLINE void quantize_group(const QuantizeArgs& a, int64_t g, uint64_t key) {
  alignas(64) float buf[kChunk];
  const QuantSpec& spec = a.spec;
  const size_t esize = dtype_size(a.dtype);
  const int64_t begin = g * spec.group_size;
  const int64_t len = std::min(spec.group_size, a.n - begin);
  const char* src = static_cast<const char*>(a.input) + begin * esize;

  // The values of elements [c, c + m) of the group: Hadamard-transformed in buf when asked
  // (chunks start on block boundaries: kChunk is a multiple of kMaxHadamardSize).
  const int hadamard = spec.hadamard_size;
  const auto values = [&](int64_t c, int64_t m) __attribute__((always_inline)) {
    const float* x = as_float(src + c * esize, a.dtype, m, buf);
    return hadamard ? hadamard_into(x, m, hadamard, buf) : x;
  };
  const bool stochastic = spec.rounding == Rounding::kStochastic;
  const math::GroupParams p = encode_group(
      len, kChunk, spec.format, spec.symmetric, values,
      [&](const float* x, int64_t c, int64_t m,
          const math::GroupParams& q) __attribute__((always_inline)) {
        code_piece(x, m, q, spec.format, spec.symmetric, stochastic, key,
                   a.index_base + static_cast<uint64_t>(begin + c),
                   a.codes + code_bytes(begin + c, spec.format));
      });
  a.scales[g] = p.scale;
  if (!spec.symmetric) a.offsets[g] = p.offset;
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
    const uint8_t* in = a.codes + code_bytes(begin + c, a.format);
    if (a.dtype == DType::kFloat32) {
      float* out = reinterpret_cast<float*>(dst + c * esize);
      decode_chunk(in, m, p, a.format, a.symmetric, out);
      if (a.hadamard_size) hadamard_blocks(out, m, a.hadamard_size);  // the inverse
      // A non-finite group's NaN scale (or offset) makes every value NaN, and an overflowing
      // inverse transform may make some: store CUDA's canonical NaN, as store_from_float
      // does for the other dtypes.
      if (!math::is_finite(p.scale) || !math::is_finite(p.offset) || a.hadamard_size)
        store_from_float(out, DType::kFloat32, m, out);
    } else {
      decode_chunk(in, m, p, a.format, a.symmetric, buf);
      if (a.hadamard_size) hadamard_blocks(buf, m, a.hadamard_size);
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
