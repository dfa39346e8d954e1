// The SIMT executor of the CUDA emulator: runs a kernel's grid on the CPU, one block at a
// time, each CUDA thread as a fiber (ucontext) with its own stack. A block's threads switch
// only at __syncthreads and at warp collectives, in thread order or in a seeded random
// order. What it checks, each an EmuError naming kernel, block and thread:
//  - a __syncthreads that not every thread of the block reaches (or reaches at another line);
//  - warp collectives whose masks disagree across lanes, name an exited or missing lane,
//    or read a lane outside the mask;
//  - shared-memory races (two threads touch a byte between two barriers, one writing) and
//    reads of shared memory not written in the block;
//  - global-memory races: a byte one thread writes, touched by another thread of the same
//    launch, or written after another thread read it (atomics aside; not checked when only
//    a sample of the blocks runs, see Config::grid_cap instead);
//  - accesses not aligned to their size (a 16-byte uint4 load at an address % 16 != 0);
//  - global accesses outside the buffers registered for the call (the kernel contract's
//    extents), and launch configurations CUDA rejects.
// Memory accesses reach it through the compiler's ThreadSanitizer instrumentation of the
// kernel sources (access_hooks.cpp); see README "Testing the CUDA kernels without a GPU".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "qcoll/error.h"

// CUDA's built-in vector types for launch dimensions and indices.
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

namespace qcoll {
namespace emu {

// A check of the emulator failed (maps to qcoll._cuda_emu.EmuError in Python).
class EmuError : public Error {
 public:
  using Error::Error;
};

enum class Schedule { kOrdered = 0, kRandom = 1 };

struct Config {
  Schedule schedule = Schedule::kOrdered;
  uint64_t seed = 0;         // random schedule and block sample
  int64_t max_blocks = 0;    // > 0: a launch with more blocks runs a sample of this many
  // > 0: a 1-D grid of more blocks runs as this many (gridDim.x included), as if the launch
  // code had capped it there, so grid-stride loops wrap at small sizes with every check on.
  int64_t grid_cap = 0;
  bool track_writes = false;  // record the global bytes each call writes
  // Global accesses outside the registered buffers are allowed, unchecked (the virtual-GPU
  // build qcoll._C_emu: the buffers are the framework's allocations, registered by nobody).
  bool any_global = false;
};

// A global buffer a kernel may touch: [base, base + bytes).
struct Buffer {
  uintptr_t base;
  size_t bytes;
  std::string name;
};

struct LaunchRecord {
  std::string kernel;
  dim3 grid, block;  // grid: as run (the launch code's, or capped by grid_cap)
  int64_t blocks_run;
  unsigned requested_grid_x;  // the launch code's grid.x
};

void configure(const Config& c);
Config config();
// Buffers of the next kernel calls (replaces the previous set), and what the calls did.
void set_buffers(std::vector<Buffer> buffers);
std::vector<LaunchRecord> take_launches();
std::vector<std::pair<uintptr_t, size_t>> take_writes();  // merged, sorted

// ---- the device-side interface (called from emulated kernel code) --------------------------
uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
void sync_threads(const char* file, int line);
uint64_t shfl_xor(unsigned mask, uint64_t value, int lane_mask, int width, const char* file,
                  int line);
unsigned atomic_max_u32(unsigned* address, unsigned value);
void host_memset(void* p, int value, size_t bytes);  // cudaMemsetAsync, bounds-checked

// Called for every instrumented load/store of kernel code; `natural`: the access is of a
// type aligned to its size, so the GPU requires that alignment.
// Per host thread in the virtual-GPU build, where kernels run on the stream threads while
// the host runs instrumented launcher code.
#if defined(QCOLL_EMU_STREAMS)
extern thread_local bool g_in_kernel;
#else
extern bool g_in_kernel;
#endif
void on_access(const void* p, size_t bytes, bool write, bool natural);

// ---- launches ---------------------------------------------------------------------------------
constexpr size_t kMaxParamBytes = 4096;  // CUDA's kernel parameter limit

struct KernelCall {
  const char* signature;  // __PRETTY_FUNCTION__ of kernel_signature<Kernel>
  dim3 grid, block;
  const unsigned char* params;  // the arguments, packed (see launch below)
  size_t params_bytes;
  void (*invoke)(const unsigned char* params);  // runs the kernel on a copy in the fiber
};

void run(const KernelCall& call);

template <auto Kernel>
const char* kernel_signature() {
  return __PRETTY_FUNCTION__;  // "... [with auto Kernel = <the kernel, with its template args>]"
}

// Byte offsets of trivially copyable arguments packed one after the other, each aligned.
template <typename... Args>
struct ParamLayout {
  static constexpr size_t kCount = sizeof...(Args);
  struct Result {
    size_t offsets[kCount + 1];
    size_t bytes;
  };
  static constexpr Result compute() {
    Result r{};
    size_t at = 0, i = 0;
    ((at = (at + alignof(Args) - 1) / alignof(Args) * alignof(Args), r.offsets[i++] = at,
      at += sizeof(Args)),
     ...);
    r.bytes = at;
    return r;
  }
  static constexpr Result kLayout = compute();
};

// Runs in the thread's fiber on the fiber's copy of the parameters: the kernel reads its
// arguments from its own stack, as a GPU thread reads them from its parameter space.
template <auto Kernel, typename... Args, size_t... I>
void invoke_kernel(const unsigned char* params, std::index_sequence<I...>) {
  Kernel(*reinterpret_cast<const Args*>(params + ParamLayout<Args...>::kLayout.offsets[I])...);
}

template <auto Kernel, typename... Args>
void invoke_packed(const unsigned char* params) {
  invoke_kernel<Kernel, Args...>(params, std::index_sequence_for<Args...>{});
}

// kernel<<<grid, block>>>(args...), run to completion on the calling thread.
template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, const Args&... args) {
  static_assert((std::is_trivially_copyable_v<Args> && ...),
                "kernel arguments must be trivially copyable, as CUDA copies them bytewise");
  constexpr auto layout = ParamLayout<Args...>::kLayout;
  static_assert(layout.bytes <= kMaxParamBytes, "kernel parameters exceed 4 KB");
  alignas(16) unsigned char packed[layout.bytes > 0 ? layout.bytes : 1];
  size_t i = 0;
  ((std::memcpy(packed + layout.offsets[i++], &args, sizeof(Args))), ...);
  run(KernelCall{kernel_signature<Kernel>(), grid, block, packed, layout.bytes,
                 &invoke_packed<Kernel, Args...>});
}

}  // namespace emu
}  // namespace qcoll
