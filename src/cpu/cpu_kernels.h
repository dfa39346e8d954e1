// CPU implementations of the kernel interface (vectorizable loops + OpenMP).
#pragma once

#include "qcoll/kernels.h"

namespace qcoll {
namespace cpu {

void quantize(const QuantizeArgs& args);
void dequantize(const DequantizeArgs& args);

}  // namespace cpu
}  // namespace qcoll
