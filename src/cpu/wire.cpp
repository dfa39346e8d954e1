// CPU wire kernels (include/qcoll/wire.h): encode slices into chunks, and the fused
// dequantize-reduce-(re)quantize over received chunks.
//
// The work items are (chunk, group) pairs for quantized outputs and (chunk, block of
// kBlock elements) pairs for raw ones; OpenMP gives each thread one contiguous range of
// them, run by the ISA variant of a driver (cpu/isa.h) like the quantize kernels,
// specialised once per call on the input dtype and the output code format. A group's fp32 values (the
// converted input slice, or the sum over sources) are built in a stack buffer of kBlock
// elements: pass 1 gathers the group's statistics, pass 2 writes the codes from the same
// buffer. Groups larger than kBlock are done piece by piece, recomputing each piece's
// values for pass 2.
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

// Elements of one stack buffer: a multiple of 8 (so int4 pieces start on whole bytes) that
// holds the usual group sizes whole.
constexpr int64_t kBlock = 2048;

// ---- chunk layout -------------------------------------------------------------------------
QCOLL_INLINE void store_scale(uint8_t* chunk, const WireFormat& fmt, int64_t len, int64_t g,
                              float s) {
  std::memcpy(chunk + fmt.scales_offset(len) + 4 * g, &s, 4);
}

QCOLL_INLINE float load_scale(const uint8_t* chunk, const WireFormat& fmt, int64_t len, int64_t g) {
  float s;
  std::memcpy(&s, chunk + fmt.scales_offset(len) + 4 * g, 4);
  return s;
}

// Zeroes the bytes of a chunk that carry no data (padding after the codes, the scales or
// the raw values), so the bytes on the wire are deterministic.
QCOLL_INLINE void zero_padding(uint8_t* chunk, const WireFormat& fmt, int64_t len) {
  const int64_t end = fmt.chunk_bytes(len);
  if (!fmt.quantized()) {
    const int64_t data = len * static_cast<int64_t>(dtype_size(fmt.raw_dtype));
    std::memset(chunk + data, 0, static_cast<size_t>(end - data));
    return;
  }
  const int64_t codes = code_bytes(len, fmt.format);
  const int64_t scales = fmt.scales_offset(len);
  std::memset(chunk + codes, 0, static_cast<size_t>(scales - codes));
  const int64_t scales_end = scales + 4 * num_groups(len, fmt.group_size);
  std::memset(chunk + scales_end, 0, static_cast<size_t>(end - scales_end));
}

// ---- codes ----------------------------------------------------------------------------------
// acc[i] += the value of code i (symmetric), in fp32 with an unfused multiply and add.
template <CodeFormat kF>
QCOLL_INLINE void decode_add(const uint8_t* in, int64_t m, float scale, float* acc) {
  with_code_values<kF>(math::GroupParams{scale, 0.0f}, /*sym=*/true, [&](const auto& value) QCOLL_LAMBDA {
    if constexpr (code_bits(kF) == 8) {
      for (int64_t i = 0; i < m; ++i) acc[i] = math::add(acc[i], value(in[i]));
      return;
    }
    const int64_t pairs = m / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      acc[2 * i] = math::add(acc[2 * i], value(in[i]));
      acc[2 * i + 1] = math::add(acc[2 * i + 1], value(static_cast<uint8_t>(in[i] >> 4)));
    }
    if (m & 1) acc[m - 1] = math::add(acc[m - 1], value(in[pairs]));
  });
}

// Error feedback (ReduceArgs::residual): after group g's codes of elements [c, c + k) were
// written, residual[c, c + k) = x - decode(codes) (zero when the codes are all zero).
// tmp: k floats of scratch.
QCOLL_INLINE void keep_residual(const float* x, int64_t k, const math::GroupParams& q,
                                CodeFormat format, const uint8_t* codes, float* residual,
                                float* tmp) {
  if (math::codes_are_zero(q)) {
    std::fill(residual, residual + k, 0.0f);
    return;
  }
  decode_chunk(codes, k, q, format, /*sym=*/true, tmp);
  for (int64_t i = 0; i < k; ++i) residual[i] = math::sub(x[i], tmp[i]);
}

// Quantizes group g of a chunk of `len` elements whose fp32 values `fill` produces
// piecewise: fill(e, k, buf) returns k values starting at element e of the chunk (buf, or
// the source itself). Writes the group's scale and codes (the encoder of quant_loops.h).
// With a residual (the chunk's, element 0; fill adds it, see ResidualFill) the group's
// residual is replaced by what its codes lose; tmp: kBlock floats of scratch, free while
// codes are written.
template <CodeFormat kF, typename Fill>
QCOLL_INLINE void encode_chunk_group(uint8_t* chunk, const WireFormat& fmt, int64_t len,
                                     int64_t g, float* buf, const Fill& fill,
                                     float* residual = nullptr, float* tmp = nullptr) {
  const int64_t begin = g * fmt.group_size;
  const int64_t m = std::min(fmt.group_size, len - begin);
  uint8_t* codes = chunk + code_bytes(begin, kF);
  const math::GroupParams p = encode_group<kF, /*kSym=*/true>(
      m, kBlock,
      [&](int64_t c, int64_t k) QCOLL_LAMBDA { return fill(begin + c, k, buf); },
      [&](const float* x, int64_t c, int64_t k,
          const math::GroupParams& q) QCOLL_LAMBDA {
        uint8_t* out = codes + code_bytes(c, kF);
        code_piece<kF, true>(x, k, q, /*stochastic=*/false, 0, 0, out);
        // Pass 1 read every piece's old residual before pass 2 replaces any.
        if (residual) keep_residual(x, k, q, fmt.format, out, residual + begin + c, tmp);
      });
  store_scale(chunk, fmt, len, g, p.scale);
}

// Block b (kBlock elements) of a raw chunk, from fill as above.
template <typename Fill>
QCOLL_INLINE void encode_block_raw(uint8_t* chunk, const WireFormat& fmt, int64_t len, int64_t b,
                                   float* buf, const Fill& fill) {
  const int64_t begin = b * kBlock;
  const int64_t k = std::min(kBlock, len - begin);
  const size_t esize = dtype_size(fmt.raw_dtype);
  store_from_float(fill(begin, k, buf), fmt.raw_dtype, k, chunk + begin * esize);
}

// `fill`, then Hadamard smoothing of the values (size 0: none). Pieces start on block
// boundaries (kBlock and group sizes are multiples of the size), so whole blocks of a piece
// are whole blocks of the chunk, and only the chunk's partial last block stays as it is.
template <typename Fill>
struct HadamardFill {
  Fill fill;
  int size;
  QCOLL_INLINE const float* operator()(int64_t e, int64_t k, float* buf) const {
    const float* x = fill(e, k, buf);
    return size ? hadamard_into(x, k, size, buf) : x;
  }
};
static_assert(kBlock % kMaxHadamardSize == 0, "blocks hold whole Hadamard blocks");

// `fill`, plus the error-feedback residual of the same elements (in the encoded domain,
// so after the Hadamard transform of an inner HadamardFill); the result is in buf.
template <typename Fill>
struct ResidualFill {
  Fill fill;
  const float* residual;  // the chunk's element 0
  QCOLL_INLINE const float* operator()(int64_t e, int64_t k, float* buf) const {
    const float* x = fill(e, k, buf);
    for (int64_t i = 0; i < k; ++i) buf[i] = math::add(x[i], residual[e + i]);
    return buf;
  }
};

// Units of work: `per_item` groups or blocks of each of `items` chunks.
struct Plan {
  int64_t per_item;
  int64_t units;
};

Plan plan(int64_t items, int64_t len, const WireFormat* fmt) {
  const int64_t per = fmt && fmt->quantized() ? num_groups(len, fmt->group_size)
                                              : num_groups(len, kBlock);
  return {per, items * per};
}

// ---- encode -----------------------------------------------------------------------------------
template <DType kT>
struct SliceFill {  // the input slice of one chunk, as fp32
  const char* src;
  QCOLL_INLINE const float* operator()(int64_t e, int64_t k, float* buf) const {
    return as_float(src + e * static_cast<int64_t>(dtype_size(kT)), kT, k, buf);
  }
};

// kF: the output format (quantized chunks only; raw ones ignore it).
template <DType kT, CodeFormat kF>
QCOLL_INLINE void encode_unit(const EncodeArgs& a, const Plan& pl, int64_t u, float* buf) {
  const int64_t k = u / pl.per_item;
  const int64_t g = u % pl.per_item;
  constexpr int64_t esize = static_cast<int64_t>(dtype_size(kT));
  const int64_t p = swizzled_partition(k, a.node_size, a.nodes);
  const char* src =
      static_cast<const char*>(a.input) + (p * a.partition_elems + a.slice_begin) * esize;
  uint8_t* chunk = a.output + k * a.chunk_stride;
  const SliceFill<kT> fill{src};
  if (a.fmt.quantized()) {
    encode_chunk_group<kF>(chunk, a.fmt, a.len, g, buf,
                           HadamardFill<SliceFill<kT>>{fill, a.fmt.hadamard_size});
  } else if (a.dtype == a.fmt.raw_dtype) {  // a copy
    const int64_t begin = g * kBlock;
    const int64_t m = std::min(kBlock, a.len - begin);
    std::memcpy(chunk + begin * esize, src + begin * esize, static_cast<size_t>(m * esize));
  } else {
    encode_block_raw(chunk, a.fmt, a.len, g, buf, fill);
  }
  if (g == pl.per_item - 1) zero_padding(chunk, a.fmt, a.len);
}

// The code format the drivers specialise on: int8 stands in where no codes are written.
QCOLL_INLINE CodeFormat code_format_of(const WireFormat* fmt) {
  return fmt && fmt->quantized() ? fmt->format : CodeFormat::kInt8;
}

QCOLL_INLINE void encode_range(const EncodeArgs& a, const Plan& pl, int64_t u0, int64_t u1) {
  alignas(64) float buf[kBlock];
  with_float_dtype(a.dtype, [&](auto t) QCOLL_LAMBDA {
    with_format(code_format_of(&a.fmt), [&](auto f) QCOLL_LAMBDA {
      for (int64_t u = u0; u < u1; ++u)
        encode_unit<decltype(t)::value, decltype(f)::value>(a, pl, u, buf);
    });
  });
}
QCOLL_ISA_VARIANTS(encode_units, encode_range,
                   (const EncodeArgs& a, const Plan& pl, int64_t u0, int64_t u1), (a, pl, u0, u1))

// ---- reduce -----------------------------------------------------------------------------------
// The sum over sources (in order, fp32) of elements [e, e + k) of output o, divided by the
// divisor unless it is 1: the first source is written, the others added.
struct SumFill {
  const ReduceArgs* a;
  int64_t o;
  float* tmp;  // kBlock floats for converting raw sources

  QCOLL_INLINE const float* operator()(int64_t e, int64_t k, float* acc) const {
    const ReduceArgs& r = *a;
    const WireFormat& fmt = r.in_fmt;
    const uint8_t* base = r.input + o * r.output_in_stride;
    for (int32_t s = 0; s < r.sources; ++s) {
      const uint8_t* chunk = base + s * r.source_stride;
      if (fmt.quantized()) {
        // Split at the input's group boundaries (multiples of 8, as e is: whole bytes).
        for (int64_t i = e; i < e + k;) {
          const int64_t ig = i / fmt.group_size;
          const int64_t j = std::min(e + k, (ig + 1) * fmt.group_size);
          const float scale = load_scale(chunk, fmt, r.len, ig);
          const uint8_t* codes = chunk + code_bytes(i, fmt.format);
          if (s == 0)
            decode_chunk(codes, j - i, math::GroupParams{scale, 0.0f}, fmt.format, true, acc + (i - e));
          else
            with_format(fmt.format, [&](auto f) QCOLL_LAMBDA {
              decode_add<decltype(f)::value>(codes, j - i, scale, acc + (i - e));
            });
          i = j;
        }
      } else {
        const char* src = reinterpret_cast<const char*>(chunk) +
                          e * static_cast<int64_t>(dtype_size(fmt.raw_dtype));
        if (s == 0) {
          load_as_float(src, fmt.raw_dtype, k, acc);
        } else {
          const float* x = as_float(src, fmt.raw_dtype, k, tmp);
          for (int64_t i = 0; i < k; ++i) acc[i] = math::add(acc[i], x[i]);
        }
      }
    }
    if (r.divisor != 1.0f) {
      const math::Divisor d = math::make_divisor(r.divisor);
      for (int64_t i = 0; i < k; ++i) acc[i] = math::divide(acc[i], d);
    }
    return acc;
  }
};

template <CodeFormat kF>  // the output format (quantized outputs only)
QCOLL_INLINE void reduce_unit(const ReduceArgs& a, const Plan& pl, int64_t u, float* buf,
                              float* tmp) {
  const int64_t o = u / pl.per_item;
  const int64_t g = u % pl.per_item;
  const HadamardFill<SumFill> fill{SumFill{&a, o, tmp}, reduce_hadamard_size(a)};
  if (!a.out_wire) {
    const int64_t begin = g * kBlock;
    const int64_t k = std::min(kBlock, a.len - begin);
    const int64_t esize = static_cast<int64_t>(dtype_size(a.out_dtype));
    char* dst = static_cast<char*>(a.out_values) + (o * a.out_values_stride + begin) * esize;
    store_from_float(fill(begin, k, buf), a.out_dtype, k, dst);
    return;
  }
  uint8_t* chunk = a.out_wire + o * a.out_chunk_stride;
  if (a.residual) {  // quantized (wire.cpp checks); tmp is free once the sum is in buf
    float* residual = a.residual + o * a.residual_stride;
    encode_chunk_group<kF>(chunk, a.out_fmt, a.len, g, buf,
                           ResidualFill<decltype(fill)>{fill, residual}, residual, tmp);
  } else if (a.out_fmt.quantized())
    encode_chunk_group<kF>(chunk, a.out_fmt, a.len, g, buf, fill);
  else
    encode_block_raw(chunk, a.out_fmt, a.len, g, buf, fill);
  if (g == pl.per_item - 1) zero_padding(chunk, a.out_fmt, a.len);
}

QCOLL_INLINE void reduce_range(const ReduceArgs& a, const Plan& pl, int64_t u0, int64_t u1) {
  alignas(64) float buf[kBlock];
  alignas(64) float tmp[kBlock];
  with_format(code_format_of(a.out_wire ? &a.out_fmt : nullptr), [&](auto f) QCOLL_LAMBDA {
    for (int64_t u = u0; u < u1; ++u) reduce_unit<decltype(f)::value>(a, pl, u, buf, tmp);
  });
}
QCOLL_ISA_VARIANTS(reduce_units, reduce_range,
                   (const ReduceArgs& a, const Plan& pl, int64_t u0, int64_t u1), (a, pl, u0, u1))

}  // namespace

void encode_chunks(const EncodeArgs& a) {
  const Plan pl = plan(a.count, a.len, &a.fmt);
  for_group_ranges(pl.units, a.len * a.count >= kParallelThreshold,
                   [&](int64_t u0, int64_t u1) { encode_units(a, pl, u0, u1); });
}

void reduce_chunks(const ReduceArgs& a) {
  const Plan pl = plan(a.outputs, a.len, a.out_wire ? &a.out_fmt : nullptr);
  for_group_ranges(pl.units, a.len * a.outputs * a.sources >= kParallelThreshold,
                   [&](int64_t u0, int64_t u1) { reduce_units(a, pl, u0, u1); });
}

}  // namespace cpu
}  // namespace qcoll
