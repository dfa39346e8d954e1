// The one CUDA kernel that turns values into codes and group parameters, shared by
// quantize.cu (a tensor into the caller's codes, scales and offsets) and wire.cu (chunk
// slices, or sums of received chunks, into wire chunks). What differs is a template
// parameter: the source (where the fp32 values come from) and the sink (where the codes
// and parameters go, with which rounding).
//
// group_size <= kTeamPiece: one team of `lanes` threads per group (up to 32 lanes reduce with
//   shuffles, 64..256 add a shared-memory step). Each lane keeps its (at most
//   kPacketsPerLane) packets in registers, so the source is read once.
// larger groups: groups are cut into kTeamPiece-element pieces, one block each, so a few huge
//   groups still fill the GPU. The sink's prepare() zeroes the parameter slots, a stats
//   pass merges each piece's statistics into them with integer atomicMax, a finalize
//   kernel turns them into the parameters, and a code pass re-reads the source and writes
//   the codes.
//
// A source has kMinBlocks (its blocks per SM, see wire.cu) and
//   load<N>(item, first, step, end, Packet (&p)[N]): the packets at elements
//   e = first + j * step < end of run `item` (e + 8 > end only for its last packet).
// A sink is a CodeRuns (the layout) with
//   symmetric(), stochastic(), key(), index(item, e): how codes are rounded;
//   finish(item): after a run's last group (fused pass), e.g. zero its padding;
//   prepare(stream) (host): zero the parameter slots before a stats pass;
//   kResidual (CodeRuns: false): error feedback, with add_residual(item, e, count, p) after
//     the Hadamard transform (every pass: stats and codes see the same values) and
//     keep_residual<F>(item, e, count, p, codes, params) after a packet's codes (fused and
//     code passes). Sinks without it compile exactly as before.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/quant_team.cuh"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cuda {
namespace team {

// `items` runs of `len` elements: run i's codes at codes + i * stride, its scales at
// scales + i * stride bytes (offsets likewise; null when symmetric).
struct CodeRuns {
  uint8_t* codes;
  float* scales;
  float* offsets;
  int64_t stride;  // bytes between runs (unused for one run)
  int64_t items;
  int64_t len;
  int64_t group_size;
  int64_t groups;            // per run
  int64_t pieces_per_group;  // split path: kTeamPiece pieces per group
  int64_t units;             // team work items: items * groups (* pieces_per_group)
  int lanes;                 // fused path: threads per team, a power of two dividing kThreads
  int hadamard;  // block size of the transform between the source and the codes (0: none)
  bool vec;      // every run's codes aligned to a packet's code bytes
  static constexpr bool kResidual = false;

  __device__ __forceinline__ uint8_t* run_codes(int64_t item) const { return codes + item * stride; }
  __device__ __forceinline__ float* at(float* base, int64_t item, int64_t g) const {
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(base) + item * stride) + g;
  }
};

struct TeamUnit {
  int64_t item, group;
  int64_t begin, end;  // element range in the run; empty past the last unit
};

template <Pass P>
__device__ __forceinline__ TeamUnit team_unit(const CodeRuns& c, int64_t u) {
  if (u >= c.units) return {0, 0, 0, 0};
  const int64_t per_item = P == Pass::kFused ? c.groups : c.groups * c.pieces_per_group;
  const int64_t item = u / per_item;
  const int64_t r = u - item * per_item;
  const int64_t g = P == Pass::kFused ? r : r / c.pieces_per_group;
  const int64_t group_begin = g * c.group_size;
  const int64_t group_end = min64(group_begin + c.group_size, c.len);
  if constexpr (P == Pass::kFused) {
    return {item, g, group_begin, group_end};
  } else {
    const int64_t begin = group_begin + (r - g * c.pieces_per_group) * kTeamPiece;
    return {item, g, begin, min64(begin + kTeamPiece, group_end)};
  }
}

template <typename Sink>
__device__ __forceinline__ void write_params(const Sink& s, int64_t item, int64_t g,
                                             const GroupParams& p) {
  *s.at(s.scales, item, g) = p.scale;
  if (!s.symmetric()) *s.at(s.offsets, item, g) = p.offset;
}

template <typename Sink>
__device__ __forceinline__ GroupParams read_params(const Sink& s, int64_t item, int64_t g) {
  return {*s.at(s.scales, item, g), s.symmetric() ? 0.0f : *s.at(s.offsets, item, g)};
}

// Split path: between the stats and finalize kernels, a group's scale and offset slots hold
// its statistics as unsigned words, zeroed by the sink's prepare() and merged with
// atomicMax. Symmetric: scale = abs_bits. Asymmetric: scale = hi_word(hi_key), offset =
// lo_word(lo_key); both maps are order-preserving (lo_word reversing) and map the identity
// of stats_identity() to 0, and each is its own inverse.
__device__ __forceinline__ uint32_t hi_word(uint32_t key) { return key ^ 0x80000000u; }
__device__ __forceinline__ uint32_t lo_word(uint32_t key) { return key ^ 0x7fffffffu; }

__device__ __forceinline__ unsigned int* slot_word(float* slot) {
  return reinterpret_cast<unsigned int*>(slot);
}

template <typename Sink>
__device__ __forceinline__ void publish_stats(const Sink& s, int64_t item, int64_t g,
                                              const GroupStats& st) {
  if (s.symmetric()) {
    atomicMax(slot_word(s.at(s.scales, item, g)), st.abs_bits);
    return;
  }
  atomicMax(slot_word(s.at(s.scales, item, g)), hi_word(static_cast<uint32_t>(st.hi_key)));
  atomicMax(slot_word(s.at(s.offsets, item, g)), lo_word(static_cast<uint32_t>(st.lo_key)));
}

__device__ __forceinline__ uint32_t magnitude_bits(int32_t key) {
  return math::float_bits(math::key_to_float(key)) & 0x7fffffffu;
}

template <typename Sink>
__device__ __forceinline__ GroupStats gathered_stats(const Sink& s, int64_t item, int64_t g) {
  GroupStats st = math::stats_identity();
  const uint32_t w = *slot_word(s.at(s.scales, item, g));
  if (s.symmetric()) {  // group_params reads only abs_bits
    st.abs_bits = w;
    return st;
  }
  st.hi_key = static_cast<int32_t>(hi_word(w));
  st.lo_key = static_cast<int32_t>(lo_word(*slot_word(s.at(s.offsets, item, g))));
  // Only two words per group: abs_bits is recovered exactly, since the sortable order puts
  // the largest magnitude of either sign at an extreme (NaN payloads included).
  const uint32_t lo = magnitude_bits(st.lo_key), hi = magnitude_bits(st.hi_key);
  st.abs_bits = lo > hi ? lo : hi;
  return st;
}

// Split path, after the stats pass: statistics -> parameters, one thread per group.
template <CodeFormat F, typename Sink>
__global__ void __launch_bounds__(kThreads) finalize_kernel(const Sink s) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < s.items * s.groups;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t item = i / s.groups, g = i - item * s.groups;
    write_params(s, item, g, math::group_params(gathered_stats(s, item, g), F, s.symmetric()));
  }
}

template <CodeFormat F, Pass P, typename Src, typename Sink>
__global__ void __launch_bounds__(kThreads, Src::kMinBlocks)
    team_kernel(const Src src, const Sink sink) {
  constexpr int Bits = code_bits(F);
  __shared__ GroupStats partial[kThreads / 32];
  const int lanes = P == Pass::kFused ? sink.lanes : kThreads;
  const int teams = kThreads / lanes;
  const int lane = threadIdx.x % lanes;
  const int team = threadIdx.x / lanes;

  // Block-uniform trip count: every thread reaches team_reduce's shuffles and barriers.
  for (int64_t first = int64_t{blockIdx.x} * teams; first < sink.units;
       first += int64_t{gridDim.x} * teams) {
    const TeamUnit unit = team_unit<P>(sink, first + team);
    const bool leader = lane == 0 && unit.begin < unit.end;
    // Lane packets are interleaved (packet lane + j * lanes) so a warp reads contiguously.
    const int64_t e0 = unit.begin + int64_t{kPacket} * lane;
    const int64_t step = int64_t{kPacket} * lanes;
    Packet cache[kPacketsPerLane] = {};
    src.load(unit.item, e0, step, unit.end, cache);
    if (sink.hadamard) {  // units start on block boundaries (group sizes and kTeamPiece are multiples)
      bool whole[kPacketsPerLane];
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j)
        whole[j] = e0 + j * step < unit.end && in_whole_block(e0 + j * step, sink.len, sink.hadamard);
      hadamard_packets(cache, whole, lane, lanes, sink.hadamard);
    }
    if constexpr (Sink::kResidual) {
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j)
        if (e0 + j * step < unit.end)
          sink.add_residual(unit.item, e0 + j * step, packet_count(unit.end - e0 - j * step),
                            cache[j]);
    }

    GroupStats s = math::stats_identity();
    if constexpr (P != Pass::kCode) {
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j)
        if (e0 + j * step < unit.end) add_packet(s, cache[j], sink.symmetric());
    }
    if constexpr (P == Pass::kStats) {
      s = team_reduce(s, lanes, partial, sink.symmetric());
      if (leader) publish_stats(sink, unit.item, unit.group, s);
    } else {
      GroupParams params{0.0f, 0.0f};
      if constexpr (P == Pass::kFused) {
        params = math::group_params(team_reduce(s, lanes, partial, sink.symmetric()), F, sink.symmetric());
        if (leader) write_params(sink, unit.item, unit.group, params);
      } else if (unit.begin < unit.end) {
        params = read_params(sink, unit.item, unit.group);
      }
      uint8_t* codes = sink.run_codes(unit.item);
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j) {
        const int64_t e = e0 + j * step;
        if (e < unit.end) {
          const uint64_t packet = code_packet<F>(cache[j], params, sink.symmetric(),
                                                 sink.stochastic(), sink.key(),
                                                 sink.index(unit.item, e));
          store_codes<Bits>(codes + e * Bits / 8, packet, packet_count(unit.end - e), sink.vec);
          if constexpr (Sink::kResidual)
            sink.template keep_residual<F>(unit.item, e, packet_count(unit.end - e), cache[j],
                                           packet, params);
        }
      }
      // After the codes, when the packets' registers are free.
      if (P == Pass::kFused && leader && unit.group == sink.groups - 1) sink.finish(unit.item);
    }
  }
}

// Fills in the sink's team fields (lanes, units, pieces_per_group) and runs the fused
// kernel, or the split path's prepare, stats, finalize and code passes.
template <CodeFormat F, typename Src, typename Sink>
void launch_team(const Src& src, Sink sink, cudaStream_t stream) {
  if (sink.group_size <= kTeamPiece) {
    sink.lanes = team_lanes(sink.group_size);
    sink.units = sink.items * sink.groups;
    launch<team_kernel<F, Pass::kFused, Src, Sink>>(grid_for(sink.units, kThreads / sink.lanes),
                                                     kThreads, stream, src, sink);
    return;
  }
  sink.lanes = kThreads;
  sink.pieces_per_group = (sink.group_size + kTeamPiece - 1) / kTeamPiece;
  sink.units = sink.items * sink.groups * sink.pieces_per_group;
  sink.prepare(stream);
  launch<team_kernel<F, Pass::kStats, Src, Sink>>(grid_for(sink.units, 1), kThreads, stream, src, sink);
  launch<finalize_kernel<F, Sink>>(grid_for(sink.items * sink.groups, kThreads), kThreads, stream,
                                   sink);
  launch<team_kernel<F, Pass::kCode, Src, Sink>>(grid_for(sink.units, 1), kThreads, stream, src, sink);
}

}  // namespace team
}  // namespace cuda
}  // namespace qcoll
