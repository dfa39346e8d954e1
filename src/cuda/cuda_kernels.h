// CUDA implementations of the kernel interface. Work is enqueued on args.device.stream and
// never synchronizes the host.
#pragma once

#include "qcoll/kernels.h"
#include "qcoll/wire.h"

namespace qcoll {
namespace cuda {

void quantize(const QuantizeArgs& args);
void dequantize(const DequantizeArgs& args);
void encode_chunks(const EncodeArgs& args);
void reduce_chunks(const ReduceArgs& args);

}  // namespace cuda
}  // namespace qcoll
