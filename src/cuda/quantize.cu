// CUDA block quantize / dequantize, bit-identical to the CPU kernels: every value goes
// through quant_math.h. Packets, element types and team reductions: cuda/quant_team.cuh.
//
// quantize, group_size <= kChunk: a team of `lanes` threads per group (up to 32 lanes reduce
//   with shuffles, 64..256 add a shared-memory step). Each lane keeps its (at most
//   kPacketsPerLane) packets in registers, so the input is read from memory once.
// quantize, larger groups: groups are cut into kChunk-element chunks, one block each, so a
//   few huge groups still fill the GPU. Per-chunk statistics are merged with integer
//   atomicMax into the scales/offsets buffers, a per-group kernel turns them into the
//   parameters, then a second pass over the input writes the codes.
// dequantize: one thread per packet, no reduction.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"
#include "cuda/launch.cuh"
#include "cuda/quant_team.cuh"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cuda {
namespace {

using namespace team;

// ---- quantize ------------------------------------------------------------------------
struct QuantParams {
  const void* input;
  uint8_t* codes;
  float* scales;
  float* offsets;
  int64_t n;
  int64_t group_size;
  int64_t units;             // work items of one team: groups, or chunks (split path)
  int64_t chunks_per_group;  // split path
  uint64_t index_base;
  uint64_t key;  // math::rng_key(seed)
  int lanes;     // fused pass: threads per team, a power of two dividing kThreads
  CodeFormat format;
  int hadamard;  // block size of the transform before quantizing (0: none)
  bool symmetric;
  bool stochastic;
  bool vec_in;   // input 16-byte aligned
  bool vec_out;  // codes aligned to a packet's code bytes
};


struct Unit {
  int64_t group;
  int64_t begin, end;  // element range; empty for a team past the end of the tensor
};

template <Pass P>
__device__ __forceinline__ Unit unit_at(const QuantParams& q, int64_t u) {
  const int64_t g = P == Pass::kFused ? u : u / q.chunks_per_group;
  const int64_t group_begin = g * q.group_size;
  const int64_t group_end = min64(group_begin + q.group_size, q.n);
  if constexpr (P == Pass::kFused) {
    return {g, group_begin, group_end};
  } else {
    const int64_t begin = group_begin + (u - g * q.chunks_per_group) * kChunk;
    return {g, begin, min64(begin + kChunk, group_end)};
  }
}

__device__ __forceinline__ void write_params(const QuantParams& q, int64_t g,
                                             const GroupParams& p) {
  q.scales[g] = p.scale;
  if (!q.symmetric) q.offsets[g] = p.offset;
}

__device__ __forceinline__ GroupParams read_params(const QuantParams& q, int64_t g) {
  return {q.scales[g], q.symmetric ? 0.0f : q.offsets[g]};
}

// Split path: between the stats and finalize kernels, scales[g] and offsets[g] hold the
// group's statistics as unsigned words, zeroed by cudaMemsetAsync and merged with
// atomicMax. Symmetric: scales = abs_bits. Asymmetric: scales = hi_word(hi_key), offsets =
// lo_word(lo_key); both maps are order-preserving (lo_word reversing) and map the identity
// of stats_identity() to 0, and each is its own inverse.
__device__ __forceinline__ uint32_t hi_word(uint32_t key) { return key ^ 0x80000000u; }
__device__ __forceinline__ uint32_t lo_word(uint32_t key) { return key ^ 0x7fffffffu; }

__device__ __forceinline__ void publish_stats(const QuantParams& q, int64_t g,
                                              const GroupStats& s) {
  unsigned int* scales = reinterpret_cast<unsigned int*>(q.scales);
  if (q.symmetric) {
    atomicMax(scales + g, s.abs_bits);
    return;
  }
  atomicMax(scales + g, hi_word(static_cast<uint32_t>(s.hi_key)));
  atomicMax(reinterpret_cast<unsigned int*>(q.offsets) + g,
            lo_word(static_cast<uint32_t>(s.lo_key)));
}

__device__ __forceinline__ uint32_t magnitude_bits(int32_t key) {
  return math::float_bits(math::key_to_float(key)) & 0x7fffffffu;
}

__device__ __forceinline__ GroupStats gathered_stats(const QuantParams& q, int64_t g) {
  GroupStats s = math::stats_identity();
  const uint32_t w = reinterpret_cast<const unsigned int*>(q.scales)[g];
  if (q.symmetric) {  // group_params reads only abs_bits
    s.abs_bits = w;
    return s;
  }
  s.hi_key = static_cast<int32_t>(hi_word(w));
  s.lo_key = static_cast<int32_t>(lo_word(reinterpret_cast<const unsigned int*>(q.offsets)[g]));
  // Only two words per group: abs_bits is recovered exactly, since the sortable order puts
  // the largest magnitude of either sign at an extreme (NaN payloads included).
  const uint32_t lo = magnitude_bits(s.lo_key), hi = magnitude_bits(s.hi_key);
  s.abs_bits = lo > hi ? lo : hi;
  return s;
}

__global__ void __launch_bounds__(kThreads) finalize_kernel(const QuantParams q, int64_t groups) {
  for (int64_t g = int64_t{blockIdx.x} * kThreads + threadIdx.x; g < groups;
       g += int64_t{gridDim.x} * kThreads)
    write_params(q, g, math::group_params(gathered_stats(q, g), q.format, q.symmetric));
}

// At least 3 blocks per SM (768 threads, 80 registers): each lane issues the loads of its
// up to 4 packets before using any (load_packets), 48-96 KB per SM in flight, and the
// register cache (32 floats per lane) still fits without spills.
template <typename E, CodeFormat F, Pass P>
__global__ void __launch_bounds__(kThreads, 3) quantize_kernel(const QuantParams q) {
  constexpr int Bits = code_bits(F);
  __shared__ GroupStats partial[kThreads / 32];
  const int lanes = P == Pass::kFused ? q.lanes : kThreads;
  const int teams = kThreads / lanes;
  const int lane = threadIdx.x % lanes;
  const int team = threadIdx.x / lanes;
  const auto* input = static_cast<const typename E::Bits*>(q.input);

  // Block-uniform trip count: every thread reaches team_reduce's shuffles and barriers.
  for (int64_t first = int64_t{blockIdx.x} * teams; first < q.units;
       first += int64_t{gridDim.x} * teams) {
    const Unit unit = unit_at<P>(q, first + team);
    const bool leader = lane == 0 && unit.begin < unit.end;
    // Lane packets are interleaved (packet lane + j * lanes) so a warp reads contiguously.
    const int64_t e0 = unit.begin + int64_t{kPacket} * lane;
    const int64_t step = int64_t{kPacket} * lanes;
    Packet cache[kPacketsPerLane] = {};
    load_packets<E>(input, e0, step, unit.end, q.vec_in, cache);
    bool whole[kPacketsPerLane];
#pragma unroll
    for (int j = 0; j < kPacketsPerLane; ++j)
      whole[j] = e0 + j * step < unit.end && in_whole_block(e0 + j * step, q.n, q.hadamard);
    // Units start on block boundaries (group sizes and kChunk are multiples of the size).
    if (q.hadamard) hadamard_packets(cache, whole, lane, lanes, q.hadamard);
    GroupStats s = math::stats_identity();
    if constexpr (P != Pass::kCode) {
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j)
        if (e0 + j * step < unit.end) add_packet(s, cache[j]);
    }

    if constexpr (P == Pass::kStats) {
      s = team_reduce(s, lanes, partial);
      if (leader) publish_stats(q, unit.group, s);
    } else {
      GroupParams params{0.0f, 0.0f};
      if constexpr (P == Pass::kFused) {
        params = math::group_params(team_reduce(s, lanes, partial), F, q.symmetric);
        if (leader) write_params(q, unit.group, params);
      } else if (unit.begin < unit.end) {
        params = read_params(q, unit.group);
      }
#pragma unroll
      for (int j = 0; j < kPacketsPerLane; ++j) {
        const int64_t e = e0 + j * step;
        if (e < unit.end) {
          const uint64_t codes = code_packet<F>(cache[j], params, q.symmetric, q.stochastic,
                                                q.key, q.index_base + e);
          store_codes<Bits>(q.codes + e * Bits / 8, codes, packet_count(unit.end - e),
                            q.vec_out);
        }
      }
    }
  }
}

// ---- dequantize ----------------------------------------------------------------------
struct DequantParams {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  void* output;
  int64_t n;
  int64_t group_size;
  bool symmetric;
  bool vec_in;   // codes aligned to a packet's code bytes
  bool vec_out;  // output 16-byte aligned
  int hadamard;  // block size of the inverse transform after decoding (0: none)
};

template <typename E, CodeFormat F>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const DequantParams d) {
  constexpr int Bits = code_bits(F);
  auto* output = static_cast<typename E::Bits*>(d.output);
  const int64_t packets = (d.n + kPacket - 1) / kPacket;
  // Block-uniform trip count: with a transform, every thread reaches its shuffles; the
  // packets of a block are consecutive threads of one warp.
  for (int64_t first = int64_t{blockIdx.x} * kThreads; first < packets;
       first += int64_t{gridDim.x} * kThreads) {
    const int64_t k = first + threadIdx.x;
    const int64_t e = k * kPacket;
    Packet p[1] = {};
    if (k < packets) {
      const int64_t g = e / d.group_size;
      const GroupParams params{d.scales[g], d.symmetric ? 0.0f : d.offsets[g]};
      const uint64_t codes = load_codes<Bits>(d.codes + e * Bits / 8, packet_count(d.n - e), d.vec_in);
      p[0] = decode_packet<F>(codes, params, d.symmetric);
    }
    if (d.hadamard) {
      const bool whole[1] = {in_whole_block(e, d.n, d.hadamard)};
      hadamard_packets(p, whole, threadIdx.x % 32, 32, d.hadamard);
    }
    if (k < packets) store_packet<E>(output + e, packet_count(d.n - e), d.vec_out, p[0]);
  }
}

template <typename E, CodeFormat F>
void launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  constexpr int Bits = code_bits(F);
  const QuantSpec& spec = a.spec;
  QuantParams q{};
  q.input = a.input;
  q.codes = a.codes;
  q.scales = a.scales;
  q.offsets = a.offsets;
  q.n = a.n;
  q.group_size = spec.group_size;
  q.index_base = a.index_base;
  q.key = math::rng_key(spec.seed);
  q.format = F;
  q.hadamard = spec.hadamard_size;
  q.symmetric = spec.symmetric;
  q.stochastic = spec.rounding == Rounding::kStochastic;
  q.vec_in = aligned(a.input, 16);
  q.vec_out = aligned(a.codes, Bits);  // a packet has Bits bytes of codes
  const int64_t groups = num_groups(a.n, spec.group_size);

  if (spec.group_size <= kChunk) {
    q.lanes = team_lanes(spec.group_size);
    q.units = groups;
    launch<quantize_kernel<E, F, Pass::kFused>>(grid_for(groups, kThreads / q.lanes), kThreads,
                                                    stream, q);
    return;
  }

  q.chunks_per_group = (spec.group_size + kChunk - 1) / kChunk;
  q.units = groups * q.chunks_per_group;
  const size_t param_bytes = static_cast<size_t>(groups) * sizeof(float);
  QCOLL_CUDA_CHECK(cudaMemsetAsync(a.scales, 0, param_bytes, stream));
  if (!spec.symmetric) QCOLL_CUDA_CHECK(cudaMemsetAsync(a.offsets, 0, param_bytes, stream));
  launch<quantize_kernel<E, F, Pass::kStats>>(grid_for(q.units, 1), kThreads, stream, q);
  launch<finalize_kernel>(grid_for(groups, kThreads), kThreads, stream, q, groups);
  launch<quantize_kernel<E, F, Pass::kCode>>(grid_for(q.units, 1), kThreads, stream, q);
}

template <typename E, CodeFormat F>
void launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  constexpr int Bits = code_bits(F);
  DequantParams d{};
  d.codes = a.codes;
  d.scales = a.scales;
  d.offsets = a.offsets;
  d.output = a.output;
  d.n = a.n;
  d.group_size = a.group_size;
  d.symmetric = a.symmetric;
  d.hadamard = a.hadamard_size;
  d.vec_in = aligned(a.codes, Bits);
  d.vec_out = aligned(a.output, 16);
  const int64_t packets = (a.n + kPacket - 1) / kPacket;
  launch<dequantize_kernel<E, F>>(grid_for(packets, kThreads), kThreads, stream, d);
}

}  // namespace

void quantize(const QuantizeArgs& args) {
  DeviceGuard guard(args.device.index);
  const auto stream = static_cast<cudaStream_t>(args.device.stream);
  dispatch(args.dtype, args.spec.format, [&](auto elem, auto format) {
    launch_quantize<decltype(elem), decltype(format)::value>(args, stream);
  });
}

void dequantize(const DequantizeArgs& args) {
  DeviceGuard guard(args.device.index);
  const auto stream = static_cast<cudaStream_t>(args.device.stream);
  dispatch(args.dtype, args.format, [&](auto elem, auto format) {
    launch_dequantize<decltype(elem), decltype(format)::value>(args, stream);
  });
}

}  // namespace cuda
}  // namespace qcoll
