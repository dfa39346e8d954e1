// The emulator module's build capabilities: its CUDA kernels are the emulated ones, so the
// entry points (kernel_dispatch.cpp, wire_dispatch.cpp) accept CUDA devices and dispatch to them.
#include "qcoll/device.h"

namespace qcoll {

bool cuda_compiled() { return true; }

}  // namespace qcoll
