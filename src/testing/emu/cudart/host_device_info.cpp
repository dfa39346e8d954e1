// cuda/device_info.cu compiled by the host compiler against the emulated CUDA runtime (qcoll._C_emu):
// the unchanged source, included so that its build settings stay its own.
#include "cuda/device_info.cu"
