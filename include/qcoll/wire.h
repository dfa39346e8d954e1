// What travels between ranks, and the two kernels that make and consume it.
//
// A chunk carries `len` consecutive elements of one destination: block-quantized codes
// then their fp32 scales (symmetric, nearest rounding), each part padded to 16 bytes, so
// payload and scales of a destination travel together and each hop is ONE all-to-all.
// With format kRaw the chunk carries the raw values in `raw_dtype` instead (no quantization).
#pragma once

#include <cstdint>

#include "qcoll/device.h"
#include "qcoll/dtype.h"
#include "qcoll/quant_spec.h"

namespace qcoll {

inline constexpr int64_t kWireAlign = 16;

inline constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct WireFormat {
  CodeFormat format = CodeFormat::kInt8;  // kRaw: raw values
  int64_t group_size = 256;
  DType raw_dtype = DType::kFloat32;  // element type of raw chunks
  int32_t hadamard_size = 0;  // quantized only: codes of Hadamard-transformed values (0: off)

  bool quantized() const { return format != CodeFormat::kRaw; }
  // Byte offset of the scales inside a chunk of `len` elements.
  int64_t scales_offset(int64_t len) const { return round_up(code_bytes(len, format), kWireAlign); }
  int64_t chunk_bytes(int64_t len) const {
    if (!quantized()) return round_up(len * static_cast<int64_t>(dtype_size(raw_dtype)), kWireAlign);
    return scales_offset(len) + round_up(num_groups(len, group_size) * 4, kWireAlign);
  }
};

// Throws ArgumentError unless format is a code format or kRaw and group_size (and
// hadamard_size) is valid.
void validate(const WireFormat& fmt);

// Encode `count` slices of `input` into consecutive chunks (Algorithm 2 of ZeRO++ fused in).
// The input is `count` partitions of `partition_elems` elements; chunk k holds elements
// [slice_begin, slice_begin + len) of partition p(k), where p(k) = k without swizzle and,
// with swizzle (node_size > 0), p(k) = (k % nodes) * node_size + k / nodes: the chunks for
// local peer j (partitions j, j + node_size, ...) become contiguous for the intra-node hop.
struct EncodeArgs {
  const void* input = nullptr;
  DType dtype = DType::kFloat32;
  int64_t partition_elems = 0;
  int64_t slice_begin = 0;
  int64_t len = 0;  // elements per slice, same for every partition
  int32_t count = 0;
  int32_t node_size = 0;  // 0: no swizzle
  int32_t nodes = 1;
  WireFormat fmt;
  uint8_t* output = nullptr;
  int64_t chunk_stride = 0;  // bytes between consecutive chunks, >= fmt.chunk_bytes(len)
  Device device;
};

// For each output o in [0, outputs): sum over s in [0, sources) (in that order, in fp32) of
// the decoded chunk at input + o * output_in_stride + s * source_stride, divide by
// `divisor` (1: sum, world size: average), then either re-encode into the chunk at
// out_wire + o * out_chunk_stride (fused dequantize-reduce-quantize, intra-node hop) or
// write `out_dtype` values at out_values + o * out_values_stride elements (last hop).
struct ReduceArgs {
  const uint8_t* input = nullptr;
  WireFormat in_fmt;
  int64_t len = 0;
  int32_t sources = 1;
  int64_t source_stride = 0;
  int32_t outputs = 1;
  int64_t output_in_stride = 0;
  float divisor = 1.0f;
  // Exactly one destination:
  uint8_t* out_wire = nullptr;
  WireFormat out_fmt;
  int64_t out_chunk_stride = 0;
  void* out_values = nullptr;
  DType out_dtype = DType::kFloat32;
  int64_t out_values_stride = 0;
  // Error feedback of a quantized out_wire (null: none): fp32, output o's `len` values
  // contiguous at residual + o * residual_stride (elements, >= len when outputs > 1), in
  // the domain that is encoded (after the reduce's Hadamard transform, if any). The value
  // encoded is v = sum + residual (math::add), and afterwards residual = v - decode(code)
  // (math::sub; the decode a receiver makes). A group whose codes are all zero (every v
  // is +-0, or the group is non-finite: NaN scale) gets residual 0, so no NaN outlives
  // the step that made it. Only elements [0, len) of each output are read or written.
  float* residual = nullptr;
  int64_t residual_stride = 0;
  Device device;
};

// The Hadamard transform a reduce applies between decoding and (re-)encoding (see below):
// its block size where the input and output domains differ, 0 where they agree.
inline int32_t reduce_hadamard_size(const ReduceArgs& a) {
  const int32_t in = a.in_fmt.hadamard_size;
  const int32_t out = a.out_wire ? a.out_fmt.hadamard_size : 0;
  return in == out ? 0 : (in ? in : out);
}

// Rules both kernels check (ArgumentError) or assume:
//  - wire buffers and strides are 4-byte aligned (fp32 scales; 32-bit atomics on the GPU);
//  - with swizzle, count == node_size * nodes;
//  - a quantized input and a quantized output chunk share one group_size, and one
//    hadamard_size where both have one;
//  - Hadamard domains: the values are transformed (whole blocks of each chunk, see
//    quant_math.h) between decoding and re-encoding exactly when the input and output
//    domains differ: raw -> Hadamard chunks forward, Hadamard chunks -> raw chunks or values
//    inverse (the transform is its own inverse); equal domains are summed as they are.
//  - out_wire does not overlap the input (not checked); a residual needs a quantized
//    out_wire, 4-byte alignment, and overlaps neither (not checked).
// Sums start from source 0's decoded value, so one source reduces to exactly its decode.
void encode_chunks(const EncodeArgs& args);
void reduce_chunks(const ReduceArgs& args);

// Partition that chunk k of a swizzled stage carries (see EncodeArgs).
inline constexpr int64_t swizzled_partition(int64_t k, int32_t node_size, int32_t nodes) {
  return node_size > 0 ? (k % nodes) * node_size + k / nodes : k;
}

}  // namespace qcoll
