// Small kernels, written as CUDA, that each break (or keep) one rule the emulator checks;
// tests/test_cuda_emu_checks.py runs them by name. Compiled like the real kernels
// (instrumented, device branch), so they go through the same checks.
#define __CUDA_ARCH__ 900
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "emu/cuda_emu.h"
#include "emu/selftest.h"

namespace qcoll {
namespace emu {
namespace {

// ---- correct kernels: what they compute is checked by the tests ----------------------------
// out[t] = the value of lane (t ^ lane_mask) within segments of `width`, via __shfl_xor_sync.
__global__ void shuffle_xor(unsigned* out, int lane_mask, int width) {
  const unsigned t = threadIdx.x;
  out[blockIdx.x * blockDim.x + t] = __shfl_xor_sync(0xffffffffu, 1000u * blockIdx.x + t,
                                                     lane_mask, width);
}

// A block-wide sum through shared memory, barriers around the shared step.
__global__ void block_sum(unsigned* out) {
  __shared__ unsigned partial[8];
  const unsigned t = threadIdx.x;
  unsigned v = t + 1;
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (t % 32 == 0) partial[t / 32] = v;
  __syncthreads();
  unsigned s = 0;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
  __syncthreads();
  out[blockIdx.x * blockDim.x + t] = s;
}

// ---- broken kernels: each must raise EmuError -----------------------------------------------
__global__ void barrier_skipped(unsigned* out) {
  if (threadIdx.x == 5) return;  // thread 5 never reaches the barrier
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void barrier_two_sites(unsigned* out) {
  if (threadIdx.x % 2)
    __syncthreads();
  else
    __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void shuffle_masks_disagree(unsigned* out) {
  const unsigned mask = threadIdx.x < 16 ? 0xffffffffu : 0xffff0000u;
  out[threadIdx.x] = __shfl_xor_sync(mask, threadIdx.x, 1);
}

__global__ void shuffle_exited_lane(unsigned* out) {
  if (threadIdx.x == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, threadIdx.x, 1);
}

__global__ void shuffle_reads_outside_mask(unsigned* out) {
  if (threadIdx.x >= 16) return;  // lanes 0..15 shuffle, but lane 0 ^ 16 is not among them
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, threadIdx.x, 16);
}

__global__ void shared_race(unsigned* out) {
  __shared__ unsigned x;
  if (threadIdx.x == 0) x = 7;
  out[threadIdx.x] = x;  // no barrier between thread 0's write and the others' reads
}

__global__ void shared_uninitialized(unsigned* out) {
  __shared__ unsigned x[64];
  if (threadIdx.x < 32) x[threadIdx.x] = 1;  // threads 32..63 read what no thread wrote
  __syncthreads();
  out[threadIdx.x] = x[threadIdx.x];
}

__global__ void misaligned_vector(unsigned* out) {
  const uint4* v = reinterpret_cast<const uint4*>(out + 1);  // 4 bytes past 16-byte alignment
  const uint4 u = v[threadIdx.x];
  out[threadIdx.x] = u.x;
}

__global__ void global_race(unsigned* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = 1;
  out[32 + blockIdx.x] = out[(blockIdx.x + 1) % gridDim.x];  // reads another block's store
}

__global__ void out_of_bounds(unsigned* out) { out[threadIdx.x + 1] = 1; }  // one past the end

// Thread t reads its neighbour's element, which the neighbour then overwrites: nothing orders
// the read before the write. Under the ordered schedule every read comes first.
__global__ void global_read_then_write(unsigned* out) {
  const unsigned t = threadIdx.x;
  const unsigned next = t + 1 < blockDim.x ? out[t + 1] : 0u;
  out[t] = next + 1;
}

struct Case {
  std::function<void(unsigned*)> launch;
  unsigned elements;  // of the output buffer
};

}  // namespace

std::vector<unsigned> run_selftest(const std::string& name, int lane_mask, int width) {
  const std::map<std::string, Case> cases = {
      {"shuffle_xor", {[=](unsigned* o) { launch<shuffle_xor>(2, 64, o, lane_mask, width); }, 128}},
      {"block_sum", {[](unsigned* o) { launch<block_sum>(3, 256, o); }, 768}},
      {"barrier_skipped", {[](unsigned* o) { launch<barrier_skipped>(1, 64, o); }, 64}},
      {"barrier_two_sites", {[](unsigned* o) { launch<barrier_two_sites>(1, 64, o); }, 64}},
      {"shuffle_masks_disagree", {[](unsigned* o) { launch<shuffle_masks_disagree>(1, 32, o); }, 32}},
      {"shuffle_exited_lane", {[](unsigned* o) { launch<shuffle_exited_lane>(1, 32, o); }, 32}},
      {"shuffle_reads_outside_mask",
       {[](unsigned* o) { launch<shuffle_reads_outside_mask>(1, 32, o); }, 32}},
      {"shared_race", {[](unsigned* o) { launch<shared_race>(1, 32, o); }, 32}},
      {"shared_uninitialized", {[](unsigned* o) { launch<shared_uninitialized>(1, 64, o); }, 64}},
      {"misaligned_vector", {[](unsigned* o) { launch<misaligned_vector>(1, 4, o); }, 32}},
      {"global_race", {[](unsigned* o) { launch<global_race>(2, 1, o); }, 64}},
      {"out_of_bounds", {[](unsigned* o) { launch<out_of_bounds>(1, 32, o); }, 32}},
      {"global_read_then_write",
       {[](unsigned* o) { launch<global_read_then_write>(1, 32, o); }, 32}},
  };
  const auto it = cases.find(name);
  if (it == cases.end()) throw ArgumentError("unknown emulator self-test '" + name + "'");
  // The launch's one global buffer: a heap block, 16-byte aligned, of exactly `elements`.
  std::vector<uint4> heap((it->second.elements + 3) / 4);
  unsigned* storage = &heap[0].x;
  std::vector<unsigned> out(it->second.elements, 0xdeadbeefu);
  std::copy(out.begin(), out.end(), storage);
  set_buffers({Buffer{reinterpret_cast<uintptr_t>(storage), out.size() * 4, "out"}});
  it->second.launch(storage);
  std::copy(storage, storage + out.size(), out.begin());
  return out;
}

}  // namespace emu
}  // namespace qcoll
