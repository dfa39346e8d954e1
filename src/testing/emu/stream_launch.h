// Kernel launches of the virtual-GPU build (qcoll._C_emu): the launch's arguments are
// packed as emu::launch packs them, and the grid runs on the launch's emulated stream
// (src/testing/emu/cudart), in that stream's order; a capture records it, a replay runs it again.
// The executor runs one grid at a time, whichever stream it comes from.
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "emu/cudart/stream_work.h"
#include "emu/runtime.h"

namespace qcoll {
namespace emu {

// Enqueues the packed launch on `stream` (stream_launch.cpp, compiled without the access
// instrumentation of the kernel sources).
void submit_launch(cudaStream_t stream, const char* signature, dim3 grid, dim3 block,
                   std::vector<unsigned char> params, size_t params_bytes,
                   void (*invoke)(const unsigned char*));

template <auto Kernel, typename... Args>
void launch_on(cudaStream_t stream, dim3 grid, dim3 block, const Args&... args) {
  static_assert((std::is_trivially_copyable_v<Args> && ...),
                "kernel arguments must be trivially copyable, as CUDA copies them bytewise");
  constexpr auto layout = ParamLayout<Args...>::kLayout;
  static_assert(layout.bytes <= kMaxParamBytes, "kernel parameters exceed 4 KB");
  std::vector<unsigned char> packed(layout.bytes > 0 ? layout.bytes : 1);  // new[]: 16-aligned
  size_t i = 0;
  ((std::memcpy(packed.data() + layout.offsets[i++], &args, sizeof(Args))), ...);
  submit_launch(stream, kernel_signature<Kernel>(), grid, block, std::move(packed), layout.bytes,
                &invoke_packed<Kernel, Args...>);
}

}  // namespace emu
}  // namespace qcoll
