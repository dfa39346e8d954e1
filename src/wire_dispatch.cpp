// Argument checks of the wire kernels (include/qcoll/wire.h), then dispatch to the CPU or
// CUDA implementation.
#include "qcoll/wire.h"

#include <cmath>
#include <cstdint>

#include "arg_checks.h"
#include "cpu/cpu_kernels.h"
#include "qcoll/error.h"
#include "qcoll/kernels.h"
#if defined(QCOLL_WITH_CUDA)
#include "cuda/cuda_kernels.h"
#endif

namespace qcoll {

void validate(const WireFormat& fmt) {
  QCOLL_ARG_CHECK(wire_format_valid(static_cast<int32_t>(fmt.format)),
                  "wire format must be int8 (0), int4 (1), fp8_e4m3 (2) or raw (3), got code ",
                  static_cast<int>(fmt.format));
  if (fmt.quantized()) {
    QuantSpec spec;
    spec.format = fmt.format;
    spec.group_size = fmt.group_size;
    spec.hadamard_size = fmt.hadamard_size;
    validate(spec);
  }
  QCOLL_ARG_CHECK(fmt.quantized() || fmt.hadamard_size == 0,
                  "hadamard_size needs quantized chunks (bits 4 or 8), got bits 0 and "
                  "hadamard_size ", fmt.hadamard_size);
  const int32_t raw = static_cast<int32_t>(fmt.raw_dtype);
  QCOLL_ARG_CHECK(fmt.quantized() ? dtype_valid(raw) : raw_dtype_valid(raw),
                  "wire dtype must be float32, float16 or bfloat16 (code 0-2)",
                  fmt.quantized() ? "" : " or raw bytes (code 3)", ", got code ", raw);
}

namespace {

using detail::check_device;

bool aligned4(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

// A run of `count` chunks of `fmt` at `base`, `stride` bytes apart. Scales are fp32, read
// and written in place (and merged with 32-bit atomics on the GPU), hence the alignment.
void check_chunks(const void* base, int64_t stride, int64_t count, const WireFormat& fmt,
                  int64_t len, const char* what) {
  QCOLL_ARG_CHECK(base, what, ": null pointer");
  QCOLL_ARG_CHECK(aligned4(base), what, ": pointer must be 4-byte aligned");
  if (count <= 1) return;  // the stride is never used
  QCOLL_ARG_CHECK(stride >= fmt.chunk_bytes(len), what, ": stride ", stride,
                  " is below the chunk size ", fmt.chunk_bytes(len), " for len ", len);
  QCOLL_ARG_CHECK(stride % 4 == 0, what, ": stride must be a multiple of 4 bytes, got ",
                  stride);
}

}  // namespace

void encode_chunks(const EncodeArgs& a) {
  validate(a.fmt);
  QCOLL_ARG_CHECK(dtype_valid(static_cast<int32_t>(a.dtype)), "encode: input dtype must be "
                  "float32, float16 or bfloat16 (code 0-2), got code ", static_cast<int>(a.dtype));
  QCOLL_ARG_CHECK(a.len >= 0, "encode: len must be >= 0, got ", a.len);
  QCOLL_ARG_CHECK(a.count >= 1, "encode: count must be >= 1, got ", a.count);
  QCOLL_ARG_CHECK(a.node_size >= 0 && a.nodes >= 1, "encode: node_size must be >= 0 and "
                  "nodes >= 1, got ", a.node_size, " and ", a.nodes);
  QCOLL_ARG_CHECK(a.node_size == 0 || int64_t{a.node_size} * a.nodes == a.count,
                  "encode: a swizzled stage needs count == node_size * nodes, got count ",
                  a.count, ", node_size ", a.node_size, ", nodes ", a.nodes);
  QCOLL_ARG_CHECK(a.slice_begin >= 0 && a.partition_elems >= 0 &&
                      a.slice_begin + a.len <= a.partition_elems,
                  "encode: slice [", a.slice_begin, ", ", a.slice_begin + a.len,
                  ") is outside the partition of ", a.partition_elems, " elements");
  check_device(a.device);
  if (a.len == 0) return;
  QCOLL_ARG_CHECK(a.input, "encode: null input pointer");
  check_chunks(a.output, a.chunk_stride, a.count, a.fmt, a.len, "encode output");
  if (a.device.kind == DeviceKind::kCPU) return cpu::encode_chunks(a);
#if defined(QCOLL_WITH_CUDA)
  cuda::encode_chunks(a);
#endif
}

void reduce_chunks(const ReduceArgs& a) {
  validate(a.in_fmt);
  QCOLL_ARG_CHECK(dtype_valid(static_cast<int32_t>(a.in_fmt.raw_dtype)),
                  "reduce: values must be float32, float16 or bfloat16 (code 0-2), got code ",
                  static_cast<int>(a.in_fmt.raw_dtype));
  QCOLL_ARG_CHECK(a.len >= 0, "reduce: len must be >= 0, got ", a.len);
  QCOLL_ARG_CHECK(a.sources >= 1, "reduce: sources must be >= 1, got ", a.sources);
  QCOLL_ARG_CHECK(a.outputs >= 1, "reduce: outputs must be >= 1, got ", a.outputs);
  QCOLL_ARG_CHECK(a.divisor > 0.0f && std::isfinite(a.divisor),
                  "reduce: divisor must be a finite number > 0, got ", a.divisor);
  QCOLL_ARG_CHECK((a.out_wire != nullptr) != (a.out_values != nullptr),
                  "reduce: exactly one of out_wire and out_values must be given");
  if (a.out_wire) {
    validate(a.out_fmt);
    QCOLL_ARG_CHECK(!a.in_fmt.quantized() || !a.out_fmt.quantized() ||
                        a.in_fmt.group_size == a.out_fmt.group_size,
                    "reduce: quantized input and output chunks must have the same group_size, "
                    "got ", a.in_fmt.group_size, " and ", a.out_fmt.group_size);
    QCOLL_ARG_CHECK(!a.in_fmt.hadamard_size || !a.out_fmt.hadamard_size ||
                        a.in_fmt.hadamard_size == a.out_fmt.hadamard_size,
                    "reduce: input and output chunks must have the same hadamard_size (or "
                    "one 0), got ", a.in_fmt.hadamard_size, " and ", a.out_fmt.hadamard_size);
  } else {
    QCOLL_ARG_CHECK(dtype_valid(static_cast<int32_t>(a.out_dtype)), "reduce: out dtype must "
                    "be float32, float16 or bfloat16 (code 0-2), got code ",
                    static_cast<int>(a.out_dtype));
  }
  QCOLL_ARG_CHECK(!a.residual || (a.out_wire && a.out_fmt.quantized()),
                  "reduce: a residual (error feedback) needs a quantized out_wire, got ",
                  a.out_wire ? "a raw out_wire" : "out_values");
  QCOLL_ARG_CHECK(!a.residual || aligned4(a.residual), "reduce: residual pointer must be "
                  "4-byte aligned");
  QCOLL_ARG_CHECK(!a.residual || a.outputs <= 1 || a.residual_stride >= a.len,
                  "reduce: residual_stride ", a.residual_stride, " is below len ", a.len);
  check_device(a.device);
  if (a.len == 0) return;
  check_chunks(a.input, a.source_stride, a.sources, a.in_fmt, a.len, "reduce input (sources)");
  check_chunks(a.input, a.output_in_stride, a.outputs, a.in_fmt, a.len,
               "reduce input (outputs)");
  if (a.out_wire) {
    check_chunks(a.out_wire, a.out_chunk_stride, a.outputs, a.out_fmt, a.len, "reduce out_wire");
  } else if (a.outputs > 1) {
    QCOLL_ARG_CHECK(a.out_values_stride >= a.len, "reduce: out_values_stride ",
                    a.out_values_stride, " is below len ", a.len);
  }
  if (a.device.kind == DeviceKind::kCPU) return cpu::reduce_chunks(a);
#if defined(QCOLL_WITH_CUDA)
  cuda::reduce_chunks(a);
#endif
}

}  // namespace qcoll
