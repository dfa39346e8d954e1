// The team machinery of the CUDA kernels, shared by quantize.cu and wire.cu: 8-element
// packets (fp32 in registers, 16-byte vector loads/stores when aligned), packed codes,
// per-packet quantize/dequantize through quant_math.h, and the reduction of a group's
// statistics over a team of lanes (shuffles, plus shared memory past one warp).
//
// The unit of work is a packet of 8 consecutive elements: one or two 16-byte loads, one
// 8-byte (int8, fp8) or 4-byte (int4) code store. group_size is a multiple of 8, so packets
// never straddle groups and only a run's last packet can be partial.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "qcoll/dtype.h"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cuda {
namespace team {

using math::GroupParams;
using math::GroupStats;

constexpr int kThreads = 256;
constexpr int kPacket = 8;          // elements per packet
constexpr int kPacketsPerLane = 4;  // packets one lane holds in registers
// Largest group one team holds in registers; also the piece of a larger group one block
// takes (split path). Not a wire chunk (wire.h).
constexpr int64_t kTeamPiece = int64_t{kThreads} * kPacketsPerLane * kPacket;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // grid cap; kernels loop over the rest

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ int packet_count(int64_t remaining) {
  return static_cast<int>(min64(remaining, kPacket));
}

__device__ __forceinline__ void zero_bytes(uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0;
}

// ---- element types: fp32 <-> storage bits, nearest-even like the CPU's conversions ----
// to_float reads the element from the low bits of its argument.
struct Fp32 {
  using Bits = uint32_t;
  __device__ static float to_float(uint32_t b) { return __uint_as_float(b); }
  // The canonical NaN as the CPU kernels store it (hardware arithmetic already gives it;
  // explicit so every path, and the emulator on x86, agree).
  __device__ static uint32_t from_float(float f) { return ::qcoll::math::float_to_fp32_bits(f); }
};

struct Bf16 {
  using Bits = uint16_t;
  __device__ static float to_float(uint32_t b) { return __uint_as_float(b << 16); }
  __device__ static uint32_t from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

struct Fp16 {
  using Bits = uint16_t;
  __device__ static float to_float(uint32_t b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  __device__ static uint32_t from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <typename E>
constexpr int kPerWord = 4 / sizeof(typename E::Bits);  // elements per 32-bit word
template <typename E>
constexpr int kVectors = sizeof(typename E::Bits) * kPacket / 16;  // uint4 per packet

struct Packet {
  float x[kPacket];
};

// A packet's storage bits as loaded: 32-bit words, element k * kPerWord + h in bits
// 16 * h of word k. Loads land here first and are converted to fp32 only once all of a
// thread's loads are issued, so the memory system holds several packets per thread.
template <typename E>
struct RawPacket {
  static constexpr int kWords = kPacket / kPerWord<E>;
  uint32_t w[kWords];
};

// `vec`: the base pointer is 16-byte aligned, hence so is every whole packet.
template <typename E>
__device__ __forceinline__ RawPacket<E> load_raw(const typename E::Bits* src, int count,
                                                 bool vec) {
  RawPacket<E> r;
  if (vec && count == kPacket) {
    const uint4* v = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int i = 0; i < kVectors<E>; ++i) {
      const uint4 u = v[i];
      r.w[4 * i] = u.x;
      r.w[4 * i + 1] = u.y;
      r.w[4 * i + 2] = u.z;
      r.w[4 * i + 3] = u.w;
    }
    return r;
  }
  // Unaligned or tail: element loads. Missing elements repeat element 0, which leaves the
  // max/min statistics unchanged; their codes are never stored.
#pragma unroll
  for (int k = 0; k < RawPacket<E>::kWords; ++k) {
    r.w[k] = 0;
#pragma unroll
    for (int h = 0; h < kPerWord<E>; ++h) {
      const int j = k * kPerWord<E> + h;
      r.w[k] |= static_cast<uint32_t>(src[j < count ? j : 0]) << (16 * h);
    }
  }
  return r;
}

template <typename E>
__device__ __forceinline__ Packet to_packet(const RawPacket<E>& r) {
  Packet p;
#pragma unroll
  for (int k = 0; k < RawPacket<E>::kWords; ++k)
#pragma unroll
    for (int h = 0; h < kPerWord<E>; ++h)
      p.x[k * kPerWord<E> + h] = E::to_float(r.w[k] >> (16 * h));
  return p;
}

// Issues the raw loads of the packets at elements e = first + j * step < end of src, then
// converts them; the other packets are zeros. e + 8 > end only for a run's last packet.
// The conversion is unconditional so that fp32 converts in place (no second register set).
template <typename E, int N>
__device__ __forceinline__ void load_packets(const typename E::Bits* src, int64_t first,
                                             int64_t step, int64_t end, bool vec,
                                             Packet (&p)[N]) {
  RawPacket<E> raw[N] = {};
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int64_t e = first + j * step;
    if (e < end) raw[j] = load_raw<E>(src + e, packet_count(end - e), vec);
  }
#pragma unroll
  for (int j = 0; j < N; ++j) p[j] = to_packet<E>(raw[j]);
}

template <typename E>
__device__ __forceinline__ void store_packet(typename E::Bits* dst, int count, bool vec,
                                             const Packet& p) {
  if (vec && count == kPacket) {
    uint4* v = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int i = 0; i < kVectors<E>; ++i) {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int h = 0; h < kPerWord<E>; ++h)
          w[k] |= E::from_float(p.x[(4 * i + k) * kPerWord<E> + h]) << (16 * h);
      v[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kPacket; ++j)
    if (j < count) dst[j] = static_cast<typename E::Bits>(E::from_float(p.x[j]));
}

// A packet's codes: element j at bit Bits * j (int4: element 2k in the low nibble of byte
// k), Bits bytes in all. `vec`: the codes base is aligned to that size.
template <int Bits>
__device__ __forceinline__ void store_codes(uint8_t* dst, uint64_t codes, int count, bool vec) {
  if (vec && count == kPacket) {
    if constexpr (Bits == 8)
      *reinterpret_cast<uint64_t*>(dst) = codes;
    else
      *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(codes);
    return;
  }
  // Drop the padding elements' codes: an odd int4 tail keeps a zero high nibble.
  if (count < kPacket) codes &= (uint64_t{1} << (count * Bits)) - 1;
#pragma unroll
  for (int b = 0; b < Bits; ++b)
    if (8 * b < count * Bits) dst[b] = static_cast<uint8_t>(codes >> (8 * b));
}

template <int Bits>
__device__ __forceinline__ uint64_t load_codes(const uint8_t* src, int count, bool vec) {
  if (vec && count == kPacket) {
    if constexpr (Bits == 8)
      return *reinterpret_cast<const uint64_t*>(src);
    else
      return *reinterpret_cast<const uint32_t*>(src);
  }
  uint64_t codes = 0;
#pragma unroll
  for (int b = 0; b < Bits; ++b)
    if (8 * b < count * Bits) codes |= static_cast<uint64_t>(src[b]) << (8 * b);
  return codes;
}

// ---- per-packet arithmetic (quant_math.h), with the uniform flags as constants ----------

// math::encode_scaled for an integer format with nearest rounding, without the two
// conversion-unit instructions (rint and float -> int, a quarter of the ALU's rate) it would
// compile to: the value is clamped first, then adding 1.5 * 2^23 rounds it half to even and
// leaves the integer, two's complement, in the low bits of the sum's mantissa. The same
// codes: the clamp bounds are integers, so clamping and rounding commute; the group's
// values and parameters are finite (codes_are_zero covers the rest).
template <CodeFormat F, bool Symmetric>
__device__ __forceinline__ uint32_t nearest_integer_code(float x, const GroupParams& p) {
  static_assert(!format_is_float(F), "integer formats only");
  const float v = Symmetric ? math::div(x, p.scale) : math::div(math::sub(x, p.offset), p.scale);
  const float c = Symmetric ? math::clampf(v, -math::qmax_symmetric(F), math::qmax_symmetric(F))
                            : math::clampf(v, 0.0f, math::levels_asymmetric(F));
  constexpr float kRoundingBias = 12582912.0f;  // 1.5 * 2^23
  return math::float_bits(math::add(c, kRoundingBias)) & ((1u << code_bits(F)) - 1);
}

template <CodeFormat F, bool Symmetric, bool Stochastic>
__device__ __forceinline__ uint64_t code_packet_as(const Packet& p, const GroupParams& params,
                                                   uint64_t key, uint64_t index0) {
  constexpr int Bits = code_bits(F);
  if (math::codes_are_zero(params)) return 0;  // once per packet, as encode_value per element
  uint64_t codes = 0;
#pragma unroll
  for (int j = 0; j < kPacket; ++j) {
    uint32_t b;
    if constexpr (!format_is_float(F) && !Stochastic) {
      b = nearest_integer_code<F, Symmetric>(p.x[j], params);
    } else {
      const float u = Stochastic ? math::uniform01(key, index0 + j) : 0.0f;
      b = math::encode_scaled<Symmetric>(p.x[j], params, F, Stochastic, u);
    }
    codes |= static_cast<uint64_t>(b) << (Bits * j);
  }
  return codes;
}

// index0: the stochastic-rounding index of the packet's first element. Float formats are
// symmetric only (validated), so their asymmetric variants are never instantiated.
template <CodeFormat F>
__device__ __forceinline__ uint64_t code_packet(const Packet& p, const GroupParams& params,
                                                bool symmetric, bool stochastic, uint64_t key,
                                                uint64_t index0) {
  if (format_is_float(F) || symmetric)
    return stochastic ? code_packet_as<F, true, true>(p, params, key, index0)
                      : code_packet_as<F, true, false>(p, params, key, index0);
  return stochastic ? code_packet_as<F, false, true>(p, params, key, index0)
                    : code_packet_as<F, false, false>(p, params, key, index0);
}

template <CodeFormat F, bool Symmetric>
__device__ __forceinline__ Packet decode_packet_as(uint64_t codes, const GroupParams& params) {
  constexpr int Bits = code_bits(F);
  Packet p;
#pragma unroll
  for (int j = 0; j < kPacket; ++j) {
    const uint8_t b = static_cast<uint8_t>(codes >> (Bits * j));
    p.x[j] = math::decode_value(b, params, F, Symmetric);
  }
  return p;
}

template <CodeFormat F>
__device__ __forceinline__ Packet decode_packet(uint64_t codes, const GroupParams& params,
                                                bool symmetric) {
  return format_is_float(F) || symmetric ? decode_packet_as<F, true>(codes, params)
                                         : decode_packet_as<F, false>(codes, params);
}

// abs_only: symmetric groups, whose parameters read the absmax alone (a third of the work).
__device__ __forceinline__ void add_packet(GroupStats& s, const Packet& p, bool abs_only) {
  if (abs_only) {
#pragma unroll
    for (int j = 0; j < kPacket; ++j) math::stats_add_abs(s, p.x[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kPacket; ++j) math::stats_add(s, p.x[j]);
  }
}

// kFused: whole groups, statistics to codes in one kernel. kStats / kCode: the two passes
// over the chunks of large groups.
enum class Pass { kFused, kStats, kCode };

// abs_only: the lo/hi keys are left as they are (add_packet's abs_only).
__device__ __forceinline__ GroupStats shfl_xor(const GroupStats& s, int mask, bool abs_only) {
  constexpr unsigned kAll = 0xffffffffu;
  GroupStats t = s;
  t.abs_bits = __shfl_xor_sync(kAll, s.abs_bits, mask);
  if (!abs_only) {
    t.lo_key = __shfl_xor_sync(kAll, s.lo_key, mask);
    t.hi_key = __shfl_xor_sync(kAll, s.hi_key, mask);
  }
  return t;
}

// Combines the statistics of the `lanes` threads of each team (aligned runs of threads).
// Every thread of the block must call it with the same `lanes` and `abs_only`.
__device__ __forceinline__ GroupStats team_reduce(GroupStats s, int lanes, GroupStats* partial,
                                                  bool abs_only) {
  for (int mask = (lanes < 32 ? lanes : 32) / 2; mask > 0; mask /= 2)
    s = math::stats_combine(s, shfl_xor(s, mask, abs_only));
  if (lanes <= 32) return s;
  const int warp = threadIdx.x / 32;
  const int warps = lanes / 32;
  if (threadIdx.x % 32 == 0) partial[warp] = s;
  __syncthreads();
  const int first = warp / warps * warps;
  s = partial[first];
  for (int w = 1; w < warps; ++w) s = math::stats_combine(s, partial[first + w]);
  __syncthreads();  // the next unit rewrites `partial`
  return s;
}

// ---- Hadamard smoothing across packets (the stage order of quant_math.h) ---------------------
// Transforms the blocks of `size` elements among the packets a team holds: p[j] is packet
// lane + j * lanes counted from a block boundary, so the partner at packet stride m is held
// by lane ^ m (a shuffle, inside the warp: m < size / 8 <= 32) when m < lanes, else by this
// lane's register j ^ (m / lanes). whole[j]: packet j's block is transformed (the same for
// every packet of a block); the others only lend their values to the shuffles. Every
// thread of the block calls it with the same lanes and size.
template <int N>
__device__ __forceinline__ void hadamard_packets(Packet (&p)[N], const bool (&whole)[N], int lane,
                                                 int lanes, int size) {
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (whole[j]) math::hadamard8(p[j].x);
  for (int m = 1; m < size / kPacket; m *= 2) {
    if (m < lanes) {
      const bool upper = (lane & m) != 0;
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int k = 0; k < kPacket; ++k) {
          const float partner = __shfl_xor_sync(0xffffffffu, p[j].x[k], m);
          if (whole[j]) p[j].x[k] = math::butterfly(p[j].x[k], partner, upper);
        }
    } else {
      const int d = m / lanes;  // < N: a block's packets fit in the team's registers
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int s = 1; s < N; s *= 2)
          if (s == d && !(j & s) && whole[j]) {
#pragma unroll
            for (int k = 0; k < kPacket; ++k) {
              const float lo = p[j].x[k], hi = p[j + s].x[k];
              p[j].x[k] = math::add(lo, hi);
              p[j + s].x[k] = math::sub(lo, hi);
            }
          }
    }
  }
  const float norm = math::hadamard_norm(size);
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (whole[j])
#pragma unroll
      for (int k = 0; k < kPacket; ++k) p[j].x[k] = math::mul(p[j].x[k], norm);
}

// Packet at element e (of a run of len elements, blocks counted from its start) is in a
// whole block: transformed.
__device__ __forceinline__ bool in_whole_block(int64_t e, int64_t len, int size) {
  return size > 0 && e / size * size + size <= len;
}

// ---- host side -----------------------------------------------------------------------
inline bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline unsigned grid_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned>(std::min((items + per_block - 1) / per_block, kMaxBlocks));
}

// Smallest power-of-two team that covers a group with kPacketsPerLane packets per lane.
inline int team_lanes(int64_t group_size) {
  const int64_t packets = group_size / kPacket;
  int lanes = 1;
  while (int64_t{lanes} * kPacketsPerLane < packets) lanes *= 2;
  return lanes;
}

// Calls f(element type tag) for a float dtype.
template <typename F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(Fp32{});
    case DType::kFloat16: return f(Fp16{});
    case DType::kBFloat16: return f(Bf16{});
    case DType::kBytes: break;  // never reaches a kernel (checked in kernel_dispatch.cpp / wire_dispatch.cpp)
  }
}

// Calls f(element type tag, std::integral_constant<CodeFormat, format>).
template <typename F>
void dispatch(DType dtype, CodeFormat format, F&& f) {
  with_dtype(dtype, [&](auto elem) { with_format(format, [&](auto code) { f(elem, code); }); });
}

}  // namespace team
}  // namespace cuda
}  // namespace qcoll
