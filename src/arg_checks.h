// Argument checks shared by the entry points of the core (kernel_dispatch.cpp, wire_dispatch.cpp).
#pragma once

#include "qcoll/device.h"
#include "qcoll/error.h"

namespace qcoll {
namespace detail {

// The device is CPU, or a CUDA device this build has kernels for.
inline void check_device(const Device& d) {
  if (d.kind == DeviceKind::kCPU) return;
  QCOLL_ARG_CHECK(d.kind == DeviceKind::kCUDA, "unknown device kind ", static_cast<int>(d.kind));
  QCOLL_ARG_CHECK(cuda_compiled(),
                  "a CUDA tensor was given but qcoll was built without CUDA kernels "
                  "(rebuild where nvcc is found, or with QCOLL_CUDA=1)");
  QCOLL_ARG_CHECK(d.index >= 0, "CUDA device index must be >= 0, got ", d.index);
}

}  // namespace detail
}  // namespace qcoll
