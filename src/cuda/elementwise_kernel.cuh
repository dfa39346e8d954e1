// The one CUDA kernel that writes a source's values as raw values of an element type,
// shared by quantize.cu (dequantize: decoded codes into the output tensor) and wire.cu
// (raw wire chunks, and reduce sums written as values). One thread per 8-element packet,
// no reduction; with a Hadamard transform, a block's packets are consecutive threads of
// one warp and the inverse transform runs across them with shuffles.
// Sources are those of team_kernel.cuh, called with N = 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/quant_team.cuh"

namespace qcoll {
namespace cuda {
namespace team {

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

// Threads per run: one per packet, padded with a transform to whole blocks so that a
// block's packets are consecutive threads of one warp.
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

// ---- host side ------------------------------------------------------------------------------
// Alignment of every run base + k * stride, k < count.
inline bool runs_aligned(const void* base, int64_t stride, int64_t count, uintptr_t bytes) {
  return aligned(base, bytes) && (count <= 1 || stride % static_cast<int64_t>(bytes) == 0);
}

inline RawRuns raw_runs(void* base, int64_t stride_bytes, int64_t items, DType dtype, int64_t len,
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

// Runs a source through the kernel for the output's element type.
template <typename Src>
void launch_elementwise(const Src& src, const RawRuns& r, DType out_dtype, cudaStream_t stream) {
  with_dtype(out_dtype, [&](auto out) {
    launch<elementwise_kernel<decltype(out), Src>>(
        grid_for(r.items * run_threads(r), kThreads), kThreads, stream, src, r);
  });
}

}  // namespace team
}  // namespace cuda
}  // namespace qcoll
