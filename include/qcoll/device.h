// Where a kernel runs. The core never owns memory: callers pass pointers on this device
// and, for CUDA, the stream (as an opaque handle) on which the work is ordered.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qcoll {

enum class DeviceKind : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int32_t index = 0;     // CUDA device ordinal
  void* stream = nullptr;  // cudaStream_t for CUDA; nullptr = legacy default stream
  // CUDA: a second stream of the caller (qcoll: the call's group's), the inter-node lane of
  // the pipelined reduce-scatter; nullptr: qcoll's own per-device lane streams.
  void* lane_stream = nullptr;
};

// Built-in capabilities, reported by qcoll.build_info().
bool cuda_compiled();
std::vector<int> cuda_archs();  // SM versions the CUDA kernels were compiled for
bool openmp_enabled();
int openmp_max_threads();
// Sets the calling thread's OpenMP team size (an ICV of each thread: a thread that OpenMP
// did not create starts from OMP_NUM_THREADS or the core count, not from its creator's);
// returns the previous one.
int set_openmp_threads(int threads);
// Number of usable GPUs right now; 0 when CUDA is not compiled in or the driver reports
// any error (no driver, no device, incompatible driver).
int cuda_device_count();
std::string cuda_runtime_version();  // "" without CUDA

}  // namespace qcoll
