// A scoped current CUDA device (with the CUDA runtime and QCOLL_CUDA_CHECK: every check
// macro lives in qcoll/error.h).
#pragma once

#include <cuda_runtime_api.h>

#include "qcoll/error.h"

namespace qcoll {
namespace cuda {

// Makes `device` current for this scope (qcoll links its own static CUDA runtime, whose
// current device is independent of the framework's) and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    QCOLL_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) QCOLL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace cuda
}  // namespace qcoll
