// What the emulated CUDA runtime offers the emulator's own parts (not a CUDA API): work
// enqueued on a stream by the kernel launcher (src/testing/emu/stream_launch.h) and by the NCCL
// stand-in (src/testing/emu/nccl). Exported by libqcoll_cudart_emu.so.
#pragma once

#include <functional>
#include <string>

#include "cuda_runtime_api.h"

namespace qcoll {
namespace vgpu {

// Runs `work` in `stream`'s order: at once on the calling thread for the null stream, on
// the stream's thread otherwise; recorded into the graph while the stream is captured (and
// run at every replay). An exception thrown by `work` is a sticky error of the emulated
// device: later runtime calls return cudaErrorLaunchFailure, failure() says what failed.
// `what` names the work in that message.
cudaError_t enqueue(cudaStream_t stream, std::function<void()> work, const char* what);

// The message of the sticky error ("" when there is none).
std::string failure();

}  // namespace vgpu
}  // namespace qcoll
