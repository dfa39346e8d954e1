// comm/nccl_comm.cpp compiled by the host compiler against the emulated CUDA runtime (qcoll._C_emu):
// the unchanged source, included so that its build settings stay its own.
#include "comm/nccl_comm.cpp"
