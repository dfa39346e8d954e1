// qcoll._C_emu's Python view of the emulated CUDA runtime (bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace qcoll {
namespace vgpu {

void bind_virtual_gpu(pybind11::module_& m);

}  // namespace vgpu
}  // namespace qcoll
