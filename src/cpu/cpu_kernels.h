// CPU implementations of the kernel interface (vectorizable loops + OpenMP).
#pragma once

#include "qcoll/kernels.h"
#include "qcoll/wire.h"

namespace qcoll {
namespace cpu {

void quantize(const QuantizeArgs& args);
void dequantize(const DequantizeArgs& args);
void encode_chunks(const EncodeArgs& args);
void reduce_chunks(const ReduceArgs& args);

}  // namespace cpu
}  // namespace qcoll
