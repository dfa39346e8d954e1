// One launch syntax for nvcc and for the CPU emulator (src/testing/emu), so that the kernels stay a
// single source: launch<kernel>(grid, block, stream, args...) is
// kernel<<<grid, block, 0, stream>>>(args...) followed by the launch-error check.
#pragma once

#include <cuda_runtime.h>

#include "cuda/device_guard.h"

namespace qcoll {
namespace cuda {

template <auto Kernel, typename... Args>
void launch(unsigned grid, unsigned block, cudaStream_t stream, const Args&... args) {
#if defined(QCOLL_EMU_STREAMS)
  emu::launch_on<Kernel>(stream, dim3(grid), dim3(block), args...);  // on the emulated stream
#elif defined(QCOLL_CUDA_EMU)
  (void)stream;  // the emulator runs the grid to completion, in call order
  emu::launch<Kernel>(dim3(grid), dim3(block), args...);
#else
  Kernel<<<grid, block, 0, stream>>>(args...);
#endif
  QCOLL_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda
}  // namespace qcoll
