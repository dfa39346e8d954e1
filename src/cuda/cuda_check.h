// CUDACHECK-style macro: a failed CUDA runtime call becomes a qcoll::Error with file:line.
#pragma once

#include <cuda_runtime_api.h>

#include "qcoll/error.h"

#define QCOLL_CUDA_CHECK(expr)                                                          \
  do {                                                                                  \
    const cudaError_t qcoll_err_ = (expr);                                              \
    QCOLL_CHECK(qcoll_err_ == cudaSuccess, "CUDA error ", cudaGetErrorName(qcoll_err_), \
                ": ", cudaGetErrorString(qcoll_err_), " in ", #expr);                   \
  } while (0)

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
