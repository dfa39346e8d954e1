// The kernel entry points as Python calls them (raw pointers, sizes, dtype codes, device and
// stream), shared by qcoll._C (bindings.cpp) and the CUDA emulator's module
// (src/testing/emu/bindings.cpp), so that both take exactly the same arguments. `run(args, entry)`
// calls entry(args): _C directly, the emulator after registering the buffers the call may
// touch.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "qcoll/device.h"
#include "qcoll/kernels.h"
#include "qcoll/wire.h"

namespace qcoll {
namespace binding {

namespace py = pybind11;

inline void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

inline Device device(int kind, int index, uintptr_t stream) {
  Device d;
  d.kind = static_cast<DeviceKind>(kind);
  d.index = index;
  d.stream = ptr(stream);
  return d;
}

// Formats travel as their codes (_C.FORMATS, RAW_FORMAT); the core validates them.
inline WireFormat wire_format(int format, int64_t group_size, int raw_dtype, int hadamard_size = 0) {
  WireFormat f;
  f.format = static_cast<CodeFormat>(format);
  f.group_size = group_size;
  f.raw_dtype = static_cast<DType>(raw_dtype);
  f.hadamard_size = hadamard_size;
  return f;
}

// Releases the GIL for the scope when asked (the emulator keeps it: it runs one call at a time).
struct MaybeReleaseGil {
  std::optional<py::gil_scoped_release> g;
  explicit MaybeReleaseGil(bool release) {
    if (release) g.emplace();
  }
};

template <typename Run>
void bind_kernels(py::module_& m, Run run, bool release_gil) {
  m.def(
      "quantize",
      [=](uintptr_t input, int dtype, int64_t n, int format, int64_t group_size, bool symmetric,
          int rounding, uint64_t seed, uint64_t index_base, uintptr_t codes, uintptr_t scales,
          uintptr_t offsets, int device_kind, int device_index, uintptr_t stream,
          int hadamard_size) {
        QuantizeArgs a;
        a.input = ptr(input);
        a.dtype = static_cast<DType>(dtype);
        a.n = n;
        a.spec.format = static_cast<CodeFormat>(format);
        a.spec.group_size = group_size;
        a.spec.symmetric = symmetric;
        a.spec.rounding = static_cast<Rounding>(rounding);
        a.spec.seed = seed;
        a.spec.hadamard_size = hadamard_size;
        a.index_base = index_base;
        a.codes = static_cast<uint8_t*>(ptr(codes));
        a.scales = static_cast<float*>(ptr(scales));
        a.offsets = static_cast<float*>(ptr(offsets));
        a.device = device(device_kind, device_index, stream);
        MaybeReleaseGil g(release_gil);
        run(a, [](const QuantizeArgs& x) { quantize(x); });
      },
      py::arg("input"), py::arg("dtype"), py::arg("n"), py::arg("format"), py::arg("group_size"),
      py::arg("symmetric"), py::arg("rounding"), py::arg("seed"), py::arg("index_base"),
      py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("device_kind"),
      py::arg("device_index"), py::arg("stream"), py::arg("hadamard_size") = 0);
  m.def(
      "dequantize",
      [=](uintptr_t codes, uintptr_t scales, uintptr_t offsets, int64_t n, int format,
          int64_t group_size, bool symmetric, uintptr_t output, int dtype, int device_kind,
          int device_index, uintptr_t stream, int hadamard_size) {
        DequantizeArgs a;
        a.codes = static_cast<const uint8_t*>(ptr(codes));
        a.scales = static_cast<const float*>(ptr(scales));
        a.offsets = static_cast<const float*>(ptr(offsets));
        a.n = n;
        a.format = static_cast<CodeFormat>(format);
        a.group_size = group_size;
        a.symmetric = symmetric;
        a.hadamard_size = hadamard_size;
        a.output = ptr(output);
        a.dtype = static_cast<DType>(dtype);
        a.device = device(device_kind, device_index, stream);
        MaybeReleaseGil g(release_gil);
        run(a, [](const DequantizeArgs& x) { dequantize(x); });
      },
      py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("n"), py::arg("format"),
      py::arg("group_size"), py::arg("symmetric"), py::arg("output"), py::arg("dtype"),
      py::arg("device_kind"), py::arg("device_index"), py::arg("stream"),
      py::arg("hadamard_size") = 0);
  m.def(
      "wire_chunk_bytes",
      [](int format, int64_t group_size, int raw_dtype, int64_t len) {
        const WireFormat f = wire_format(format, group_size, raw_dtype);
        validate(f);
        return f.chunk_bytes(len);
      },
      py::arg("format"), py::arg("group_size"), py::arg("raw_dtype"), py::arg("len"));
  m.def(
      "encode_chunks",
      [=](uintptr_t input, int dtype, int64_t partition_elems, int64_t slice_begin, int64_t len,
          int count, int node_size, int nodes, int format, int64_t group_size, uintptr_t output,
          int64_t chunk_stride, int device_kind, int device_index, uintptr_t stream,
          int hadamard_size) {
        EncodeArgs a;
        a.input = ptr(input);
        a.dtype = static_cast<DType>(dtype);
        a.partition_elems = partition_elems;
        a.slice_begin = slice_begin;
        a.len = len;
        a.count = count;
        a.node_size = node_size;
        a.nodes = nodes;
        a.fmt = wire_format(format, group_size, dtype, hadamard_size);
        a.output = static_cast<uint8_t*>(ptr(output));
        a.chunk_stride = chunk_stride;
        a.device = device(device_kind, device_index, stream);
        MaybeReleaseGil g(release_gil);
        run(a, [](const EncodeArgs& x) { encode_chunks(x); });
      },
      py::arg("input"), py::arg("dtype"), py::arg("partition_elems"), py::arg("slice_begin"),
      py::arg("len"), py::arg("count"), py::arg("node_size"), py::arg("nodes"), py::arg("format"),
      py::arg("group_size"), py::arg("output"), py::arg("chunk_stride"),
      py::arg("device_kind"), py::arg("device_index"), py::arg("stream"),
      py::arg("hadamard_size") = 0);
  m.def(
      "reduce_chunks",
      [=](uintptr_t input, int in_format, int64_t group_size, int raw_dtype, int64_t len,
          int sources, int64_t source_stride, int outputs, int64_t output_in_stride,
          float divisor, uintptr_t out_wire, int out_format, int64_t out_chunk_stride,
          uintptr_t out_values, int out_dtype, int64_t out_values_stride, int device_kind,
          int device_index, uintptr_t stream, int in_hadamard, int out_hadamard,
          uintptr_t residual, int64_t residual_stride) {
        ReduceArgs a;
        a.input = static_cast<const uint8_t*>(ptr(input));
        a.in_fmt = wire_format(in_format, group_size, raw_dtype, in_hadamard);
        a.len = len;
        a.sources = sources;
        a.source_stride = source_stride;
        a.outputs = outputs;
        a.output_in_stride = output_in_stride;
        a.divisor = divisor;
        a.out_wire = static_cast<uint8_t*>(ptr(out_wire));
        a.out_fmt = wire_format(out_format, group_size, raw_dtype, out_hadamard);
        a.out_chunk_stride = out_chunk_stride;
        a.out_values = ptr(out_values);
        a.out_dtype = static_cast<DType>(out_dtype);
        a.out_values_stride = out_values_stride;
        a.residual = static_cast<float*>(ptr(residual));
        a.residual_stride = residual_stride;
        a.device = device(device_kind, device_index, stream);
        MaybeReleaseGil g(release_gil);
        run(a, [](const ReduceArgs& x) { reduce_chunks(x); });
      },
      py::arg("input"), py::arg("in_format"), py::arg("group_size"), py::arg("raw_dtype"),
      py::arg("len"), py::arg("sources"), py::arg("source_stride"), py::arg("outputs"),
      py::arg("output_in_stride"), py::arg("divisor"), py::arg("out_wire"), py::arg("out_format"),
      py::arg("out_chunk_stride"), py::arg("out_values"), py::arg("out_dtype"),
      py::arg("out_values_stride"), py::arg("device_kind"), py::arg("device_index"),
      py::arg("stream"), py::arg("in_hadamard") = 0, py::arg("out_hadamard") = 0,
      py::arg("residual") = 0, py::arg("residual_stride") = 0);
}

}  // namespace binding
}  // namespace qcoll
