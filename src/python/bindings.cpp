// The one binding file: Python passes raw pointers (tensor.data_ptr()), sizes, dtype codes
// and a stream handle; no framework header is included, so any framework can call in.
// qcoll::ArgumentError derives from std::invalid_argument, which pybind11 raises as
// ValueError; other qcoll errors become RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "qcoll/device.h"
#include "qcoll/kernels.h"

namespace py = pybind11;

namespace {

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

qcoll::Device device(int kind, int index, uintptr_t stream) {
  qcoll::Device d;
  d.kind = static_cast<qcoll::DeviceKind>(kind);
  d.index = index;
  d.stream = ptr(stream);
  return d;
}

void quantize(uintptr_t input, int dtype, int64_t n, int bits, int64_t group_size,
              bool symmetric, int rounding, uint64_t seed, uint64_t index_base, uintptr_t codes,
              uintptr_t scales, uintptr_t offsets, int device_kind, int device_index,
              uintptr_t stream) {
  qcoll::QuantizeArgs a;
  a.input = ptr(input);
  a.dtype = static_cast<qcoll::DType>(dtype);
  a.n = n;
  a.spec.bits = bits;
  a.spec.group_size = group_size;
  a.spec.symmetric = symmetric;
  a.spec.rounding = static_cast<qcoll::Rounding>(rounding);
  a.spec.seed = seed;
  a.index_base = index_base;
  a.codes = static_cast<uint8_t*>(ptr(codes));
  a.scales = static_cast<float*>(ptr(scales));
  a.offsets = static_cast<float*>(ptr(offsets));
  a.device = device(device_kind, device_index, stream);
  qcoll::quantize(a);
}

void dequantize(uintptr_t codes, uintptr_t scales, uintptr_t offsets, int64_t n, int bits,
                int64_t group_size, bool symmetric, uintptr_t output, int dtype, int device_kind,
                int device_index, uintptr_t stream) {
  qcoll::DequantizeArgs a;
  a.codes = static_cast<const uint8_t*>(ptr(codes));
  a.scales = static_cast<const float*>(ptr(scales));
  a.offsets = static_cast<const float*>(ptr(offsets));
  a.n = n;
  a.bits = bits;
  a.group_size = group_size;
  a.symmetric = symmetric;
  a.output = ptr(output);
  a.dtype = static_cast<qcoll::DType>(dtype);
  a.device = device(device_kind, device_index, stream);
  qcoll::dequantize(a);
}

py::dict build_info() {
  py::dict d;
  d["version"] = QCOLL_VERSION;
  d["cuda"] = qcoll::cuda_compiled();
  d["cuda_archs"] = qcoll::cuda_archs();
  d["cuda_runtime"] = qcoll::cuda_runtime_version();
  d["openmp"] = qcoll::openmp_enabled();
  d["openmp_threads"] = qcoll::openmp_max_threads();
  d["cuda_available"] = qcoll::cuda_device_count() > 0;
  d["cuda_device_count"] = qcoll::cuda_device_count();
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "qcoll core kernels (raw-pointer interface; use the qcoll package instead)";
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("quantize", &quantize, release, py::arg("input"), py::arg("dtype"), py::arg("n"),
        py::arg("bits"), py::arg("group_size"), py::arg("symmetric"), py::arg("rounding"),
        py::arg("seed"), py::arg("index_base"), py::arg("codes"), py::arg("scales"),
        py::arg("offsets"), py::arg("device_kind"), py::arg("device_index"), py::arg("stream"));
  m.def("dequantize", &dequantize, release, py::arg("codes"), py::arg("scales"),
        py::arg("offsets"), py::arg("n"), py::arg("bits"), py::arg("group_size"),
        py::arg("symmetric"), py::arg("output"), py::arg("dtype"), py::arg("device_kind"),
        py::arg("device_index"), py::arg("stream"));
  m.def("build_info", &build_info);
  m.attr("GROUP_SIZE_MULTIPLE") = qcoll::kGroupSizeMultiple;
  m.attr("MAX_GROUP_SIZE") = qcoll::kMaxGroupSize;
}
