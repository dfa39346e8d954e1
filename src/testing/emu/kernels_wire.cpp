// src/cuda/wire.cu compiled by the host compiler for the emulator: the unchanged source,
// with __CUDA_ARCH__ defined so that shared host/device helpers take their device branch.
#define __CUDA_ARCH__ 900
#include "emu/cuda_emu.h"
#include "cuda/wire.cu"
