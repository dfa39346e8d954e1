// CUDA wire kernels (include/qcoll/wire.h), bit-identical to src/cpu/wire.cpp: every value
// goes through quant_math.h, with the packets and teams of cuda/quant_team.cuh.
//
// A "source" produces the fp32 values of a chunk's packets: the input slice of the chunk's
// partition (encode), or the sum over the received chunks of an output (reduce; sources
// added in order, first written, then divided). Sums stay in registers: the reduce is a
// fused dequantize-reduce-quantize with no fp32 round trip through memory.
//
// Quantized outputs, group_size <= kChunk: the quantize team kernel, one team per (chunk,
//   group): each lane holds its packets' values in registers, the team reduces the
//   group's absmax, and the lanes write codes; the team leader writes the scale and, for
//   a chunk's last group, zeroes the chunk's padding.
// Quantized outputs, larger groups: the split path of quantize. A prepare kernel zeroes
//   each chunk's scale slots and padding; a stats pass (one block per kChunk piece of a
//   group) merges absmax bits into the scale slot with atomicMax; a finalize kernel turns
//   them into scales; a code pass recomputes the values (re-reading the input, or for
//   reduce re-summing the sources) and writes the codes.
// Raw outputs (raw chunks, or values of out_dtype): one thread per packet; raw encode of
//   the input's own dtype is a bit copy.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"
#include "cuda/launch.cuh"
#include "cuda/quant_team.cuh"
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

__device__ __forceinline__ void zero_bytes(uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0;
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
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int k = 0; k < kPacket; ++k) p[j].x[k] = math::div(p[j].x[k], divisor);
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
    // group, which sits inside an input group (equal group sizes, checked by wire.cpp).
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

// ---- quantized outputs ----------------------------------------------------------------------
struct QuantChunks {  // `items` chunks of `len` elements at base + item * stride
  uint8_t* base;
  int64_t stride;
  int64_t len;
  int64_t group_size;
  int64_t groups;  // per chunk
  int64_t code_bytes;
  int64_t scales_offset;
  int64_t chunk_bytes;
  int64_t items;
  int64_t chunks_per_group;  // split path: kChunk pieces per group
  int64_t units;             // team work items: items * groups (* chunks_per_group)
  int lanes;                 // fused path
  CodeFormat format;
  int hadamard;  // block size of the transform between the source and the codes (0: none)
  bool vec;  // every chunk's codes aligned to a packet's code bytes

  __device__ __forceinline__ uint8_t* chunk(int64_t item) const { return base + item * stride; }
  __device__ __forceinline__ float* scale(int64_t item, int64_t g) const {
    return reinterpret_cast<float*>(chunk(item) + scales_offset) + g;
  }
};

struct TeamUnit {
  int64_t item, group;
  int64_t begin, end;  // element range in the chunk; empty past the last unit
};

template <Pass P>
__device__ __forceinline__ TeamUnit team_unit(const QuantChunks& c, int64_t u) {
  if (u >= c.units) return {0, 0, 0, 0};
  const int64_t per_item = P == Pass::kFused ? c.groups : c.groups * c.chunks_per_group;
  const int64_t item = u / per_item;
  const int64_t r = u - item * per_item;
  const int64_t g = P == Pass::kFused ? r : r / c.chunks_per_group;
  const int64_t group_begin = g * c.group_size;
  const int64_t group_end = min64(group_begin + c.group_size, c.len);
  if constexpr (P == Pass::kFused) {
    return {item, g, group_begin, group_end};
  } else {
    const int64_t begin = group_begin + (r - g * c.chunks_per_group) * kChunk;
    return {item, g, begin, min64(begin + kChunk, group_end)};
  }
}

__device__ __forceinline__ void zero_quant_padding(const QuantChunks& c, int64_t item) {
  uint8_t* chunk = c.chunk(item);
  zero_bytes(chunk + c.code_bytes, c.scales_offset - c.code_bytes);
  const int64_t scales_end = c.scales_offset + 4 * c.groups;
  zero_bytes(chunk + scales_end, c.chunk_bytes - scales_end);
}

// The quantize team kernel (src/cuda/quantize.cu), symmetric and nearest, with the values
// from `src` and the codes and scales into chunks.
template <CodeFormat F, Pass P, typename Src>
__global__ void __launch_bounds__(kThreads, Src::kMinBlocks) team_kernel(const Src src, const QuantChunks c) {
  constexpr int Bits = code_bits(F);
  __shared__ GroupStats partial[kThreads / 32];
  const int lanes = P == Pass::kFused ? c.lanes : kThreads;
  const int teams = kThreads / lanes;
  const int lane = threadIdx.x % lanes;
  const int team = threadIdx.x / lanes;

  // Block-uniform trip count: every thread reaches team_reduce's shuffles and barriers.
  for (int64_t first = int64_t{blockIdx.x} * teams; first < c.units;
       first += int64_t{gridDim.x} * teams) {
    const TeamUnit unit = team_unit<P>(c, first + team);
    const bool leader = lane == 0 && unit.begin < unit.end;
    // Lane packets are interleaved (packet lane + j * lanes) so a warp reads contiguously.
    const int64_t e0 = unit.begin + int64_t{kPacket} * lane;
    const int64_t step = int64_t{kPacket} * lanes;
    Packet cache[kPacketsPerLane] = {};
    src.load(unit.item, e0, step, unit.end, cache);
    if (c.hadamard) {  // units start on block boundaries, as in quantize.cu
      bool whole[kPacketsPerLane];
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j)
        whole[j] = e0 + j * step < unit.end && in_whole_block(e0 + j * step, c.len, c.hadamard);
      hadamard_packets(cache, whole, lane, lanes, c.hadamard);
    }

    GroupStats s = math::stats_identity();
    if constexpr (P != Pass::kCode) {
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j)
        if (e0 + j * step < unit.end) add_packet(s, cache[j]);
    }
    if constexpr (P == Pass::kStats) {
      s = team_reduce(s, lanes, partial);
      if (leader) atomicMax(reinterpret_cast<unsigned int*>(c.scale(unit.item, unit.group)), s.abs_bits);
    } else {
      GroupParams params{0.0f, 0.0f};
      if constexpr (P == Pass::kFused) {
        params = math::group_params(team_reduce(s, lanes, partial), F, /*symmetric=*/true);
        if (leader) *c.scale(unit.item, unit.group) = params.scale;
      } else if (unit.begin < unit.end) {
        params.scale = *c.scale(unit.item, unit.group);
      }
      uint8_t* chunk = c.chunk(unit.item);
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j) {
        const int64_t e = e0 + j * step;
        if (e < unit.end) {
          const uint64_t codes = code_packet<F>(cache[j], params, /*symmetric=*/true,
                                                /*stochastic=*/false, 0, 0);
          store_codes<Bits>(chunk + e * Bits / 8, codes, packet_count(unit.end - e), c.vec);
        }
      }
      // After the codes, when the packets' registers are free.
      if (P == Pass::kFused && leader && unit.group == c.groups - 1)
        zero_quant_padding(c, unit.item);
    }
  }
}

// Split path, before the stats pass: scale slots (atomicMax targets) and padding to 0.
__global__ void __launch_bounds__(kThreads) prepare_kernel(const QuantChunks c) {
  const int64_t per_item = c.chunk_bytes - c.code_bytes;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < c.items * per_item;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t item = i / per_item;
    c.chunk(item)[c.code_bytes + (i - item * per_item)] = 0;
  }
}

// Split path, after the stats pass: absmax bits -> scale.
__global__ void __launch_bounds__(kThreads) finalize_kernel(const QuantChunks c) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < c.items * c.groups;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t item = i / c.groups;
    float* slot = c.scale(item, i - item * c.groups);
    GroupStats s = math::stats_identity();
    s.abs_bits = *reinterpret_cast<const unsigned int*>(slot);  // symmetric: only abs_bits
    *slot = math::group_params(s, c.format, /*symmetric=*/true).scale;
  }
}

template <CodeFormat F, typename Src>
void launch_team(const Src& src, QuantChunks c, cudaStream_t stream) {
  if (c.group_size <= kChunk) {
    c.lanes = team_lanes(c.group_size);
    c.units = c.items * c.groups;
    launch<team_kernel<F, Pass::kFused, Src>>(grid_for(c.units, kThreads / c.lanes), kThreads,
                                                  stream, src, c);
    return;
  }
  c.lanes = kThreads;
  c.chunks_per_group = (c.group_size + kChunk - 1) / kChunk;
  c.units = c.items * c.groups * c.chunks_per_group;
  launch<prepare_kernel>(grid_for(c.items * (c.chunk_bytes - c.code_bytes), kThreads), kThreads,
                         stream, c);
  launch<team_kernel<F, Pass::kStats, Src>>(grid_for(c.units, 1), kThreads, stream, src, c);
  launch<finalize_kernel>(grid_for(c.items * c.groups, kThreads), kThreads, stream, c);
  launch<team_kernel<F, Pass::kCode, Src>>(grid_for(c.units, 1), kThreads, stream, src, c);
}

// ---- raw outputs ------------------------------------------------------------------------------
struct RawRuns {  // `items` runs of `len` elements at base + item * stride bytes
  uint8_t* base;
  int64_t stride;
  int64_t len;
  int64_t items;
  int64_t data_bytes;  // len * element size
  int64_t end_bytes;   // raw chunk: chunk_bytes (the rest is zeroed); values: data_bytes
  int hadamard;        // block size of the (inverse) transform of the source's values (0: none)
  bool vec;            // every run 16-byte aligned
};

// Threads per run of the elementwise kernel: one per packet, padded with a transform to
// whole blocks so that a block's packets are consecutive threads of one warp.
__host__ __device__ __forceinline__ int64_t run_threads(const RawRuns& r) {
  const int64_t packets = (r.len + kPacket - 1) / kPacket;
  const int64_t per_block = r.hadamard ? r.hadamard / kPacket : 1;
  return (packets + per_block - 1) / per_block * per_block;
}

__device__ __forceinline__ void zero_raw_padding(const RawRuns& r, int64_t item, int64_t e) {
  if (e + kPacket >= r.len)  // the thread of the run's last packet
    zero_bytes(r.base + item * r.stride + r.data_bytes, r.end_bytes - r.data_bytes);
}

template <typename Eout, typename Src>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const Src src, const RawRuns r) {
  const int64_t per_run = run_threads(r);
  // Block-uniform trip count: with a transform, every thread reaches its shuffles.
  for (int64_t first = int64_t{blockIdx.x} * kThreads; first < r.items * per_run;
       first += int64_t{gridDim.x} * kThreads) {
    const int64_t i = first + threadIdx.x;
    const int64_t item = i / per_run;
    const int64_t e = (i - item * per_run) * kPacket;
    const bool valid = item < r.items && e < r.len;
    Packet p[1] = {};
    if (valid) src.load(item, e, kPacket, r.len, p);
    if (r.hadamard) {
      const bool whole[1] = {valid && in_whole_block(e, r.len, r.hadamard)};
      hadamard_packets(p, whole, threadIdx.x % 32, 32, r.hadamard);
    }
    if (!valid) continue;
    auto* dst = reinterpret_cast<typename Eout::Bits*>(r.base + item * r.stride);
    store_packet<Eout>(dst + e, packet_count(r.len - e), r.vec, p[0]);
    zero_raw_padding(r, item, e);
  }
}

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
// Alignment of every run base + k * stride, k < count.
bool runs_aligned(const void* base, int64_t stride, int64_t count, uintptr_t bytes) {
  return aligned(base, bytes) && (count <= 1 || stride % static_cast<int64_t>(bytes) == 0);
}

QuantChunks quant_chunks(uint8_t* base, int64_t stride, int64_t items, const WireFormat& fmt,
                         int64_t len) {
  QuantChunks c{};
  c.base = base;
  c.stride = stride;
  c.len = len;
  c.group_size = fmt.group_size;
  c.groups = num_groups(len, fmt.group_size);
  c.code_bytes = code_bytes(len, fmt.format);
  c.scales_offset = fmt.scales_offset(len);
  c.chunk_bytes = fmt.chunk_bytes(len);
  c.items = items;
  c.format = fmt.format;
  // A packet's codes take code_bits bytes (8 codes).
  c.vec = runs_aligned(base, stride, items, static_cast<uintptr_t>(code_bits(fmt.format)));
  return c;
}

RawRuns raw_runs(void* base, int64_t stride_bytes, int64_t items, DType dtype, int64_t len,
                 int64_t end_bytes) {
  RawRuns r{};
  r.base = static_cast<uint8_t*>(base);
  r.stride = stride_bytes;
  r.len = len;
  r.items = items;
  r.data_bytes = len * static_cast<int64_t>(dtype_size(dtype));
  r.end_bytes = end_bytes;
  r.vec = runs_aligned(base, stride_bytes, items, 16);
  return r;
}

template <typename F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(Fp32{});
    case DType::kFloat16: return f(Fp16{});
    case DType::kBFloat16: return f(Bf16{});
    case DType::kBytes: break;  // never reaches a kernel (checked in wire.cpp)
  }
}

// Runs a source through the kernel that the output format asks for.
template <typename Src>
void launch_elementwise(const Src& src, const RawRuns& r, DType out_dtype, cudaStream_t stream) {
  with_dtype(out_dtype, [&](auto out) {
    launch<elementwise_kernel<decltype(out), Src>>(
        grid_for(r.items * run_threads(r), kThreads), kThreads, stream, src, r);
  });
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
      QuantChunks c = quant_chunks(a.output, a.chunk_stride, a.count, a.fmt, a.len);
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
    QuantChunks c = quant_chunks(a.out_wire, a.out_chunk_stride, a.outputs, a.out_fmt, a.len);
    c.hadamard = hadamard;
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
