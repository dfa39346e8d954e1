// Argument checks shared by every device, then dispatch to the CPU or CUDA kernels.
#include "qcoll/kernels.h"

#include "arg_checks.h"
#include "cpu/cpu_kernels.h"
#include "qcoll/error.h"
#if defined(QCOLL_WITH_CUDA)
#include "cuda/cuda_kernels.h"
#endif

namespace qcoll {

void validate(const QuantSpec& spec) {
  QCOLL_ARG_CHECK(format_valid(static_cast<int32_t>(spec.format)),
                  "format must be int8 (0), int4 (1) or fp8_e4m3 (2), got code ",
                  static_cast<int>(spec.format));
  QCOLL_ARG_CHECK(spec.symmetric || !format_is_float(spec.format), format_name(spec.format),
                  " codes are symmetric only (symmetric=True)");
  QCOLL_ARG_CHECK(spec.group_size >= kGroupSizeMultiple && spec.group_size <= kMaxGroupSize &&
                      spec.group_size % kGroupSizeMultiple == 0,
                  "group_size must be a positive multiple of ", kGroupSizeMultiple, " up to ",
                  kMaxGroupSize, ", got ", spec.group_size);
  QCOLL_ARG_CHECK(spec.rounding == Rounding::kNearest || spec.rounding == Rounding::kStochastic,
                  "rounding must be nearest (0) or stochastic (1), got ",
                  static_cast<int>(spec.rounding));
  validate_hadamard(spec.hadamard_size, spec.group_size);
}

void validate_hadamard(int64_t hadamard_size, int64_t group_size) {
  if (hadamard_size == 0) return;
  QCOLL_ARG_CHECK(hadamard_size >= kMinHadamardSize && hadamard_size <= kMaxHadamardSize &&
                      (hadamard_size & (hadamard_size - 1)) == 0 &&
                      group_size % hadamard_size == 0,
                  "hadamard_size must be 0 (off) or a power of two from ", kMinHadamardSize,
                  " to ", kMaxHadamardSize, " that divides group_size ", group_size, ", got ",
                  hadamard_size);
}

using detail::check_device;

void quantize(const QuantizeArgs& a) {
  validate(a.spec);
  QCOLL_ARG_CHECK(a.n >= 0, "numel must be >= 0, got ", a.n);
  QCOLL_ARG_CHECK(dtype_valid(static_cast<int32_t>(a.dtype)), "input dtype must be float32, "
                  "float16 or bfloat16 (code 0-2), got code ", static_cast<int>(a.dtype));
  check_device(a.device);
  if (a.n == 0) return;
  QCOLL_ARG_CHECK(a.input && a.codes && a.scales, "quantize: null input, codes or scales pointer");
  QCOLL_ARG_CHECK(a.spec.symmetric || a.offsets, "asymmetric quantize needs an offsets buffer");
  if (a.device.kind == DeviceKind::kCPU) return cpu::quantize(a);
#if defined(QCOLL_WITH_CUDA)
  cuda::quantize(a);
#endif
}

void dequantize(const DequantizeArgs& a) {
  QuantSpec spec;
  spec.format = a.format;
  spec.group_size = a.group_size;
  spec.symmetric = a.symmetric;
  spec.hadamard_size = a.hadamard_size;
  validate(spec);
  QCOLL_ARG_CHECK(a.n >= 0, "numel must be >= 0, got ", a.n);
  QCOLL_ARG_CHECK(dtype_valid(static_cast<int32_t>(a.dtype)), "output dtype must be float32, "
                  "float16 or bfloat16 (code 0-2), got code ", static_cast<int>(a.dtype));
  check_device(a.device);
  if (a.n == 0) return;
  QCOLL_ARG_CHECK(a.codes && a.scales && a.output, "dequantize: null codes, scales or output pointer");
  QCOLL_ARG_CHECK(a.symmetric || a.offsets, "asymmetric dequantize needs the offsets");
  if (a.device.kind == DeviceKind::kCPU) return cpu::dequantize(a);
#if defined(QCOLL_WITH_CUDA)
  cuda::dequantize(a);
#endif
}

}  // namespace qcoll
