// CUDA wire kernels (include/qcoll/wire.h), bit-identical to src/cpu/wire.cpp: every value
// goes through quant_math.h, with the packets and teams of cuda/quant_team.cuh.
//
// A "source" produces the fp32 values of a chunk's packets: the input slice of the chunk's
// partition (encode), or the sum over the received chunks of an output (reduce; sources
// added in order, first written, then divided). Sums stay in registers: the reduce is a
// fused dequantize-reduce-quantize with no fp32 round trip through memory.
//
// Quantized outputs: team_kernel.cuh's kernel (the one quantize.cu uses), with a ChunkSink:
//   symmetric, nearest, each chunk's scales after its codes and its padding zeroed.
// Raw outputs (raw chunks, or values of out_dtype): elementwise_kernel.cuh's kernel; raw
//   encode of the input's own dtype is a bit copy.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device_guard.h"
#include "cuda/cuda_kernels.h"
#include "cuda/elementwise_kernel.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_team.cuh"
#include "cuda/team_kernel.cuh"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cuda {
namespace {

using namespace team;

// swizzled_partition of wire.h (a host function), for the device; k < count fits 32 bits.
__device__ __forceinline__ int64_t partition_of(int64_t k, int node_size, int nodes) {
  const int k32 = static_cast<int>(k);
  return node_size > 0 ? int64_t{k32 % nodes} * node_size + k32 / nodes : k;
}

// Missing elements of a run's last packet repeat element 0: they leave the statistics
// unchanged, and their values are never stored.
__device__ __forceinline__ void pad_tail(Packet& p, int count) {
#pragma unroll
  for (int j = 1; j < kPacket; ++j)
    if (j >= count) p.x[j] = p.x[0];
}

// ---- sources -----------------------------------------------------------------------------
// load<N>(item, first, step, end, p) fills p[j] for the packets at elements
// e = first + j * step < end of chunk (or output) `item`; `end` is the end of the current
// group or piece, so e + 8 > end only for the chunk's last packet.

// kMinBlocks: the team kernel's blocks per SM (launch bounds), chosen for the bytes in
// flight (~16 KB per SM saturate HBM) without spills (ptxas -v, sm_90, nvcc 13.0):
// - a slice: 3 (768 threads, 80 registers); a lane issues its up to 4 packets' loads before
//   using any (load_packets): 64 (16-bit) or 128 (fp32) bytes per thread, 48-96 KB per SM.
// - a sum over sources: 2 (512 threads, 128 registers; 98-124 used) for the fp32 sums
//   beside kSourcesInFlight raw packets: 8 quantized sources keep 32 (int4) or 64 (8-bit)
//   bytes of codes per thread in flight, 16-32 KB per SM; 4 raw sources 64 or 128 bytes,
//   32-64 KB per SM.

template <typename E>
struct SliceSource {  // encode: elements [slice_begin, +len) of partition p(item)
  static constexpr int kMinBlocks = 3;
  const typename E::Bits* input;
  int64_t partition_elems;
  int64_t slice_begin;
  int node_size;
  int nodes;
  bool vec;  // every slice 16-byte aligned

  template <int N>
  __device__ __forceinline__ void load(int64_t item, int64_t first, int64_t step, int64_t end,
                                       Packet (&p)[N]) const {
    const auto* src =
        input + partition_of(item, node_size, nodes) * partition_elems + slice_begin;
    load_packets<E>(src, first, step, end, vec, p);
  }
};

struct SumLayout {  // reduce: chunk of output o, source s at input + o * out + s * source
  const uint8_t* input;
  int64_t source_stride;
  int64_t output_stride;
  int sources;
  float divisor;
};

template <int N>
__device__ __forceinline__ void divide(Packet (&p)[N], float divisor) {
  if (divisor == 1.0f) return;
  const math::Divisor d = math::make_divisor(divisor);
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int k = 0; k < kPacket; ++k) p[j].x[k] = math::divide(p[j].x[k], d);
}

__device__ __forceinline__ void accumulate(Packet& acc, const Packet& d, bool first) {
  if (first) {
    acc = d;
    return;
  }
#pragma unroll
  for (int k = 0; k < kPacket; ++k) acc.x[k] = math::add(acc.x[k], d.x[k]);
}

// Sums one packet over sources 0, 1, 2, ... in that order (as the CPU does: bit-identity),
// K sources at a time: the raw loads of a batch are all issued before the first is
// decoded and added, so K packets are in flight rather than one. Batching sources per
// packet, rather than all of a lane's packets of several sources, keeps the registers of
// only K raw packets live beside the sums (the latter spilled with 8-bit codes).
template <int K, typename Raw, typename Load, typename Add>
__device__ __forceinline__ void sum_sources(int sources, const Load& load, const Add& add) {
  for (int s0 = 0; s0 < sources; s0 += K) {
    Raw raw[K];
#pragma unroll
    for (int t = 0; t < K; ++t)
      if (s0 + t < sources) raw[t] = load(s0 + t);
#pragma unroll
    for (int t = 0; t < K; ++t)
      if (s0 + t < sources) add(s0 + t, raw[t]);
  }
}

template <CodeFormat InF>
struct QuantSumSource {  // reduce of quantized chunks
  static constexpr int kMinBlocks = 2;
  static constexpr int kSourcesInFlight = 8;
  static constexpr int InBits = code_bits(InF);
  SumLayout l;
  int64_t scales_offset;  // of the input chunks
  int64_t group_size;     // of the input chunks
  bool vec;               // every input chunk aligned to a packet's code bytes

  template <int N>
  __device__ __forceinline__ void load(int64_t item, int64_t first, int64_t step, int64_t end,
                                       Packet (&acc)[N]) const {
    const uint8_t* chunks = l.input + item * l.output_stride;
    // All packets of one load lie in one input group: N == 1, or the team of one output
    // group, which sits inside an input group (equal group sizes, checked by wire_dispatch.cpp).
    const int64_t scale_at = scales_offset + 4 * (first / group_size);
    struct Raw {
      float scale;
      uint64_t codes;
    };
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t e = first + j * step;
      if (e >= end) continue;
      const int count = packet_count(end - e);
      sum_sources<kSourcesInFlight, Raw>(
          l.sources,
          [&](int s) {
            const uint8_t* chunk = chunks + s * l.source_stride;
            return Raw{*reinterpret_cast<const float*>(chunk + scale_at),
                       load_codes<InBits>(chunk + e * InBits / 8, count, vec)};
          },
          [&](int s, const Raw& r) {
            const GroupParams p{r.scale, 0.0f};
            accumulate(acc[j], decode_packet<InF>(r.codes, p, /*symmetric=*/true), s == 0);
          });
      pad_tail(acc[j], count);
    }
    divide(acc, l.divisor);
  }
};

template <typename E>
struct RawSumSource {  // reduce of raw chunks
  static constexpr int kMinBlocks = 2;
  static constexpr int kSourcesInFlight = 4;
  SumLayout l;
  bool vec;  // every input chunk 16-byte aligned

  template <int N>
  __device__ __forceinline__ void load(int64_t item, int64_t first, int64_t step, int64_t end,
                                       Packet (&acc)[N]) const {
    const uint8_t* chunks = l.input + item * l.output_stride;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t e = first + j * step;
      if (e >= end) continue;
      const int count = packet_count(end - e);
      sum_sources<kSourcesInFlight, RawPacket<E>>(
          l.sources,
          [&](int s) {
            const auto* src = reinterpret_cast<const typename E::Bits*>(chunks + s * l.source_stride);
            return load_raw<E>(src + e, count, vec);
          },
          [&](int s, const RawPacket<E>& r) { accumulate(acc[j], to_packet<E>(r), s == 0); });
    }
    divide(acc, l.divisor);
  }
};

// ---- quantized outputs: the sink of the team kernel ---------------------------------------
// `items` chunks of `len` elements at base + item * stride: codes, then the scales at
// scales_offset, then zero padding to chunk_bytes. Symmetric, nearest rounding.
struct ChunkSink : CodeRuns {
  int64_t code_bytes;
  int64_t scales_offset;
  int64_t chunk_bytes;

  __device__ static constexpr bool symmetric() { return true; }
  __device__ static constexpr bool stochastic() { return false; }
  __device__ static constexpr uint64_t key() { return 0; }
  __device__ static constexpr uint64_t index(int64_t, int64_t) { return 0; }

  __device__ __forceinline__ void finish(int64_t item) const {  // zero the chunk's padding
    uint8_t* chunk = run_codes(item);
    zero_bytes(chunk + code_bytes, scales_offset - code_bytes);
    const int64_t scales_end = scales_offset + 4 * groups;
    zero_bytes(chunk + scales_end, chunk_bytes - scales_end);
  }

  void prepare(cudaStream_t stream) const;
};

// Split path, before the stats pass: scale slots (atomicMax targets) and padding to 0.
__global__ void __launch_bounds__(kThreads) prepare_kernel(const ChunkSink c) {
  const int64_t per_item = c.chunk_bytes - c.code_bytes;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < c.items * per_item;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t item = i / per_item;
    c.codes[item * c.stride + c.code_bytes + (i - item * per_item)] = 0;
  }
}

void ChunkSink::prepare(cudaStream_t stream) const {
  launch<prepare_kernel>(grid_for(items * (chunk_bytes - code_bytes), kThreads), kThreads, stream,
                         *this);
}

// Error feedback of a quantized output (ReduceArgs::residual): run `item`'s residual at
// residual + item * residual_stride. The team kernel adds it to the values (after the
// Hadamard transform) and replaces it by value - decode(codes) once the codes are made.
struct ResidualChunkSink : ChunkSink {
  static constexpr bool kResidual = true;
  float* residual;
  int64_t residual_stride;  // elements
  bool residual_vec;        // every run's residual 16-byte aligned

  __device__ __forceinline__ float* residual_at(int64_t item, int64_t e) const {
    return residual + item * residual_stride + e;
  }

  __device__ __forceinline__ void add_residual(int64_t item, int64_t e, int count,
                                               Packet& p) const {
    const float* r = residual_at(item, e);
    Packet q;
    if (residual_vec && count == kPacket) {
      *reinterpret_cast<float4*>(q.x) = reinterpret_cast<const float4*>(r)[0];
      *reinterpret_cast<float4*>(q.x + 4) = reinterpret_cast<const float4*>(r)[1];
    } else {
#pragma unroll
      for (int k = 0; k < kPacket; ++k) q.x[k] = k < count ? r[k] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kPacket; ++k) p.x[k] = math::add(p.x[k], q.x[k]);
    pad_tail(p, count);  // missing elements repeat element 0 again (statistics unchanged)
  }

  template <CodeFormat F>
  __device__ __forceinline__ void keep_residual(int64_t item, int64_t e, int count,
                                                const Packet& p, uint64_t codes,
                                                const GroupParams& params) const {
    Packet q;
    if (math::codes_are_zero(params)) {  // +-0 values or a non-finite group: nothing kept
#pragma unroll
      for (int k = 0; k < kPacket; ++k) q.x[k] = 0.0f;
    } else {
      const Packet d = decode_packet<F>(codes, params, /*symmetric=*/true);
#pragma unroll
      for (int k = 0; k < kPacket; ++k) q.x[k] = math::sub(p.x[k], d.x[k]);
    }
    float* r = residual_at(item, e);
    if (residual_vec && count == kPacket) {
      reinterpret_cast<float4*>(r)[0] = *reinterpret_cast<const float4*>(q.x);
      reinterpret_cast<float4*>(r)[1] = *reinterpret_cast<const float4*>(q.x + 4);
      return;
    }
#pragma unroll
    for (int k = 0; k < kPacket; ++k)
      if (k < count) r[k] = q.x[k];
  }
};

// ---- raw outputs ------------------------------------------------------------------------------
// Raw encode in the input's own dtype: the bits are copied (NaN payloads included).
template <typename E>
__global__ void __launch_bounds__(kThreads) copy_kernel(const SliceSource<E> src, const RawRuns r) {
  using Bits = typename E::Bits;
  const int64_t packets = (r.len + kPacket - 1) / kPacket;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < r.items * packets;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t item = i / packets;
    const int64_t e = (i - item * packets) * kPacket;
    const Bits* in = src.input + partition_of(item, src.node_size, src.nodes) * src.partition_elems +
                     src.slice_begin + e;
    Bits* out = reinterpret_cast<Bits*>(r.base + item * r.stride) + e;
    const int count = packet_count(r.len - e);
    if (src.vec && r.vec && count == kPacket) {
#pragma unroll
      for (int v = 0; v < kVectors<E>; ++v)
        reinterpret_cast<uint4*>(out)[v] = reinterpret_cast<const uint4*>(in)[v];
    } else {
      for (int j = 0; j < count; ++j) out[j] = in[j];
    }
    zero_raw_padding(r, item, e);
  }
}

// ---- host side ------------------------------------------------------------------------------
ChunkSink chunk_sink(uint8_t* base, int64_t stride, int64_t items, const WireFormat& fmt,
                     int64_t len) {
  ChunkSink c{};
  c.codes = base;
  c.scales = reinterpret_cast<float*>(base + fmt.scales_offset(len));
  c.offsets = nullptr;
  c.stride = stride;
  c.len = len;
  c.group_size = fmt.group_size;
  c.groups = num_groups(len, fmt.group_size);
  c.code_bytes = code_bytes(len, fmt.format);
  c.scales_offset = fmt.scales_offset(len);
  c.chunk_bytes = fmt.chunk_bytes(len);
  c.items = items;
  // A packet's codes take code_bits bytes (8 codes).
  c.vec = runs_aligned(base, stride, items, static_cast<uintptr_t>(code_bits(fmt.format)));
  return c;
}

}  // namespace

void encode_chunks(const EncodeArgs& a) {
  DeviceGuard guard(a.device.index);
  const auto stream = static_cast<cudaStream_t>(a.device.stream);
  const int64_t esize = static_cast<int64_t>(dtype_size(a.dtype));
  with_dtype(a.dtype, [&](auto elem) {
    using E = decltype(elem);
    SliceSource<E> src{};
    src.input = static_cast<const typename E::Bits*>(a.input);
    src.partition_elems = a.partition_elems;
    src.slice_begin = a.slice_begin;
    src.node_size = a.node_size;
    src.nodes = a.nodes;
    src.vec = aligned(a.input, 16) && (a.partition_elems * esize) % 16 == 0 &&
              (a.slice_begin * esize) % 16 == 0;
    if (a.fmt.quantized()) {
      ChunkSink c = chunk_sink(a.output, a.chunk_stride, a.count, a.fmt, a.len);
      c.hadamard = a.fmt.hadamard_size;
      with_format(a.fmt.format, [&](auto f) { launch_team<decltype(f)::value>(src, c, stream); });
      return;
    }
    const RawRuns r = raw_runs(a.output, a.chunk_stride, a.count, a.fmt.raw_dtype, a.len,
                               a.fmt.chunk_bytes(a.len));
    if (a.fmt.raw_dtype == a.dtype) {
      launch<copy_kernel<E>>(grid_for(r.items * run_threads(r), kThreads),
                             kThreads, stream, src, r);
    } else {
      launch_elementwise(src, r, a.fmt.raw_dtype, stream);
    }
  });
}

void reduce_chunks(const ReduceArgs& a) {
  DeviceGuard guard(a.device.index);
  const auto stream = static_cast<cudaStream_t>(a.device.stream);
  const SumLayout layout{a.input, a.source_stride, a.output_in_stride, a.sources, a.divisor};
  const int hadamard = reduce_hadamard_size(a);

  // The output side, given the source.
  const auto run = [&](const auto& src) {
    using Src = std::decay_t<decltype(src)>;
    if (a.out_values) {
      const int64_t esize = static_cast<int64_t>(dtype_size(a.out_dtype));
      RawRuns r = raw_runs(a.out_values, a.out_values_stride * esize, a.outputs,
                           a.out_dtype, a.len, a.len * esize);
      r.hadamard = hadamard;
      return launch_elementwise(src, r, a.out_dtype, stream);
    }
    if (!a.out_fmt.quantized()) {
      RawRuns r = raw_runs(a.out_wire, a.out_chunk_stride, a.outputs, a.out_fmt.raw_dtype,
                           a.len, a.out_fmt.chunk_bytes(a.len));
      r.hadamard = hadamard;
      return launch_elementwise(src, r, a.out_fmt.raw_dtype, stream);
    }
    ChunkSink c = chunk_sink(a.out_wire, a.out_chunk_stride, a.outputs, a.out_fmt, a.len);
    c.hadamard = hadamard;
    if (a.residual) {
      ResidualChunkSink rc{c};
      rc.residual = a.residual;
      rc.residual_stride = a.residual_stride;
      rc.residual_vec = runs_aligned(a.residual, a.residual_stride * 4, a.outputs, 16);
      with_format(a.out_fmt.format,
                  [&](auto f) { launch_team<decltype(f)::value, Src>(src, rc, stream); });
      return;
    }
    with_format(a.out_fmt.format, [&](auto f) { launch_team<decltype(f)::value, Src>(src, c, stream); });
  };

  if (a.in_fmt.quantized()) {
    const int64_t in_bits = code_bits(a.in_fmt.format);  // a packet's code bytes
    const bool vec = runs_aligned(a.input, a.source_stride, a.sources, in_bits) &&
                     runs_aligned(a.input, a.output_in_stride, a.outputs, in_bits);
    with_format(a.in_fmt.format, [&](auto f) {
      QuantSumSource<decltype(f)::value> src{};
      src.l = layout;
      src.scales_offset = a.in_fmt.scales_offset(a.len);
      src.group_size = a.in_fmt.group_size;
      src.vec = vec;
      run(src);
    });
    return;
  }
  const bool vec = runs_aligned(a.input, a.source_stride, a.sources, 16) &&
                   runs_aligned(a.input, a.output_in_stride, a.outputs, 16);
  with_dtype(a.in_fmt.raw_dtype, [&](auto elem) {
    RawSumSource<decltype(elem)> src{};
    src.l = layout;
    src.vec = vec;
    run(src);
  });
}

}  // namespace cuda
}  // namespace qcoll
