// Stands in for <cuda_runtime.h> in the virtual-GPU build (qcoll._C_emu): the emulated
// runtime API, plus the kernel emulator's device surface in the kernel sources.
#pragma once
#include "cuda_runtime_api.h"
#if defined(__CUDA_ARCH__)
#include "emu/cuda_emu.h"
#endif
