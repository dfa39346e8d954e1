// Stands in for the CUDA toolkit's <cuda_runtime_api.h> when the kernels are compiled for the emulator.
#pragma once
#include "emu/cuda_emu.h"
