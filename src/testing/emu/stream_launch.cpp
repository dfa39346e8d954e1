// The enqueue half of the virtual-GPU build's kernel launches (stream_launch.h): a grid runs
// on its stream's thread, one grid at a time across streams (the executor is one machine).
#include <mutex>

#include "emu/stream_launch.h"

namespace qcoll {
namespace emu {

void submit_launch(cudaStream_t stream, const char* signature, dim3 grid, dim3 block,
                   std::vector<unsigned char> params, size_t params_bytes,
                   void (*invoke)(const unsigned char*)) {
  // Never destroyed, as the runtime's state (runtime.cpp's rt()): a stream thread may hold
  // it while the process exits.
  static std::mutex* executor = new std::mutex;
  // A refused enqueue (a faulted device, an invalidated capture) sets the error that the
  // launcher's cudaGetLastError check then reports.
  vgpu::enqueue(
      stream,
      [signature, grid, block, params = std::move(params), params_bytes, invoke] {
        std::lock_guard<std::mutex> lock(*executor);
        run(KernelCall{signature, grid, block, params.data(), params_bytes, invoke});
        take_launches();  // nobody reads the records in this build
      },
      "kernel launch");
}

}  // namespace emu
}  // namespace qcoll
