// Kernel entry points of the core: raw pointers, sizes, dtype codes and a device/stream.
// Each call validates its arguments (ArgumentError) and dispatches to the CPU or CUDA
// implementation, which share the arithmetic in quant_math.h.
#pragma once

#include <cstdint>

#include "qcoll/device.h"
#include "qcoll/dtype.h"
#include "qcoll/quant_spec.h"

namespace qcoll {

struct QuantizeArgs {
  const void* input = nullptr;  // n contiguous elements of `dtype`
  DType dtype = DType::kFloat32;
  int64_t n = 0;
  QuantSpec spec;
  uint64_t index_base = 0;  // logical index of input[0]: stochastic draws use base + i
  uint8_t* codes = nullptr;   // code_bytes(n, bits)
  float* scales = nullptr;    // num_groups(n, group_size)
  float* offsets = nullptr;   // asymmetric only, num_groups(n, group_size)
  Device device;
};

struct DequantizeArgs {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  const float* offsets = nullptr;  // asymmetric only
  int64_t n = 0;
  int32_t bits = 8;
  int64_t group_size = 256;
  bool symmetric = true;
  int32_t hadamard_size = 0;  // the codes are of transformed values: invert after decoding
  void* output = nullptr;  // n contiguous elements of `dtype`
  DType dtype = DType::kFloat32;
  Device device;
};

void quantize(const QuantizeArgs& args);
void dequantize(const DequantizeArgs& args);

}  // namespace qcoll
