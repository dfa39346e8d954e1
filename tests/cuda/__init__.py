"""CUDA: the kernels under the SIMT emulator and on a GPU, NCCL, streams, the GPU run script."""
