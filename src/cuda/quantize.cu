// CUDA block quantize / dequantize, bit-identical to the CPU kernels: every value goes
// through quant_math.h. Both are the kernels wire.cu uses too, with a tensor as source and
// sink: quantize is team_kernel.cuh's kernel (the input's values into the caller's codes,
// scales and offsets), dequantize is elementwise_kernel.cuh's (decoded codes into the
// output). Packets, element types and team reductions: cuda/quant_team.cuh.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_guard.h"
#include "cuda/cuda_kernels.h"
#include "cuda/elementwise_kernel.cuh"
#include "cuda/quant_team.cuh"
#include "cuda/team_kernel.cuh"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cuda {
namespace {

using namespace team;

// ---- sources ---------------------------------------------------------------------------------
template <typename E>
struct TensorSource {  // quantize: the input tensor, one run
  // 3 blocks per SM (768 threads, 80 registers), as wire.cu's SliceSource: a lane issues
  // its up to 4 packets' loads before using any, 48-96 KB per SM in flight.
  static constexpr int kMinBlocks = 3;
  const typename E::Bits* input;
  bool vec;  // 16-byte aligned

  template <int N>
  __device__ __forceinline__ void load(int64_t, int64_t first, int64_t step, int64_t end,
                                       Packet (&p)[N]) const {
    load_packets<E>(input, first, step, end, vec, p);
  }
};

template <CodeFormat F>
struct CodesSource {  // dequantize: a tensor's codes, decoded with their groups' parameters
  static constexpr int Bits = code_bits(F);
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t group_size;
  bool symmetric;
  bool vec;  // codes aligned to a packet's code bytes

  template <int N>
  __device__ __forceinline__ void load(int64_t, int64_t first, int64_t step, int64_t end,
                                       Packet (&p)[N]) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t e = first + j * step;
      if (e >= end) continue;
      const int64_t g = e / group_size;
      const GroupParams params{scales[g], symmetric ? 0.0f : offsets[g]};
      const uint64_t packet = load_codes<Bits>(codes + e * Bits / 8, packet_count(end - e), vec);
      p[j] = decode_packet<F>(packet, params, symmetric);
    }
  }
};

// ---- sink ------------------------------------------------------------------------------------
// The caller's codes, scales and offsets (one run); symmetry and rounding chosen at run time.
struct TensorSink : CodeRuns {
  uint64_t rng_key;  // math::rng_key(seed)
  uint64_t index_base;
  bool is_symmetric;
  bool is_stochastic;

  __device__ __forceinline__ bool symmetric() const { return is_symmetric; }
  __device__ __forceinline__ bool stochastic() const { return is_stochastic; }
  __device__ __forceinline__ uint64_t key() const { return rng_key; }
  __device__ __forceinline__ uint64_t index(int64_t, int64_t e) const { return index_base + e; }
  __device__ __forceinline__ void finish(int64_t) const {}  // no padding

  void prepare(cudaStream_t stream) const {
    const size_t bytes = static_cast<size_t>(groups) * sizeof(float);
    QCOLL_CUDA_CHECK(cudaMemsetAsync(scales, 0, bytes, stream));
    if (!is_symmetric) QCOLL_CUDA_CHECK(cudaMemsetAsync(offsets, 0, bytes, stream));
  }
};

// ---- host side -------------------------------------------------------------------------------
template <typename E, CodeFormat F>
void launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  const QuantSpec& spec = a.spec;
  const TensorSource<E> src{static_cast<const typename E::Bits*>(a.input), aligned(a.input, 16)};
  TensorSink sink{};
  sink.codes = a.codes;
  sink.scales = a.scales;
  sink.offsets = a.offsets;
  sink.items = 1;
  sink.len = a.n;
  sink.group_size = spec.group_size;
  sink.groups = num_groups(a.n, spec.group_size);
  sink.hadamard = spec.hadamard_size;
  sink.vec = aligned(a.codes, code_bits(F));  // a packet has code_bits bytes of codes
  sink.rng_key = math::rng_key(spec.seed);
  sink.index_base = a.index_base;
  sink.is_symmetric = spec.symmetric;
  sink.is_stochastic = spec.rounding == Rounding::kStochastic;
  launch_team<F>(src, sink, stream);
}

template <typename E, CodeFormat F>
void launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  CodesSource<F> src{};
  src.codes = a.codes;
  src.scales = a.scales;
  src.offsets = a.offsets;
  src.group_size = a.group_size;
  src.symmetric = a.symmetric;
  src.vec = aligned(a.codes, code_bits(F));
  const int64_t bytes = a.n * static_cast<int64_t>(sizeof(typename E::Bits));
  RawRuns r = raw_runs(a.output, bytes, 1, a.dtype, a.n, bytes);
  r.hadamard = a.hadamard_size;
  launch<elementwise_kernel<E, CodesSource<F>>>(grid_for(run_threads(r), kThreads), kThreads,
                                                  stream, src, r);
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
