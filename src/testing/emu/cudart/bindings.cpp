// The emulated CUDA runtime's streams, events and graphs for Python (qcoll._C_emu, the
// virtual-GPU build): what qcoll._vgpu puts behind torch.cuda's stream interface. Handles
// are the runtime's pointers as integers, as torch's Stream.cuda_stream is.
#include "emu/cudart/bindings.h"

#include <chrono>
#include <cstdint>
#include <thread>
#include <string>

#include "emu/cudart/cuda_runtime_api.h"
#include "emu/cudart/stream_work.h"
#include "qcoll/error.h"

namespace py = pybind11;

namespace qcoll {
namespace vgpu {
namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::string msg = std::string("virtual GPU: ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ")";
  const std::string why = failure();
  if (!why.empty()) msg += "; device fault: " + why;
  throw Error(msg);
}

template <typename T>
T* as(uintptr_t h) {
  return reinterpret_cast<T*>(h);
}

cudaStreamCaptureMode parse_mode(const std::string& mode) {
  if (mode == "global") return cudaStreamCaptureModeGlobal;
  if (mode == "thread_local") return cudaStreamCaptureModeThreadLocal;
  if (mode == "relaxed") return cudaStreamCaptureModeRelaxed;
  throw ArgumentError("capture mode must be 'global', 'thread_local' or 'relaxed', got '" + mode + "'");
}

const char* mode_name(cudaStreamCaptureMode m) {
  return m == cudaStreamCaptureModeGlobal ? "global"
         : m == cudaStreamCaptureModeThreadLocal ? "thread_local" : "relaxed";
}

}  // namespace

void bind_virtual_gpu(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  m.def("vgpu_stream_create", [] {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return reinterpret_cast<uintptr_t>(s);
  });
  m.def("vgpu_stream_synchronize", [](uintptr_t s) {
    check(cudaStreamSynchronize(as<CUstream_st>(s)), "cudaStreamSynchronize");
  }, G());
  m.def("vgpu_stream_query", [](uintptr_t s) {
    const cudaError_t e = cudaStreamQuery(as<CUstream_st>(s));
    if (e == cudaErrorNotReady) return false;
    check(e, "cudaStreamQuery");
    return true;
  });
  m.def("vgpu_stream_wait_event", [](uintptr_t s, uintptr_t e) {
    check(cudaStreamWaitEvent(as<CUstream_st>(s), as<CUevent_st>(e), 0), "cudaStreamWaitEvent");
  }, G());
  m.def("vgpu_event_create", [] {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return reinterpret_cast<uintptr_t>(e);
  });
  m.def("vgpu_event_destroy", [](uintptr_t e) { cudaEventDestroy(as<CUevent_st>(e)); });
  m.def("vgpu_event_record", [](uintptr_t e, uintptr_t s) {
    check(cudaEventRecord(as<CUevent_st>(e), as<CUstream_st>(s)), "cudaEventRecord");
  });
  m.def("vgpu_event_query", [](uintptr_t e) {
    const cudaError_t r = cudaEventQuery(as<CUevent_st>(e));
    if (r == cudaErrorNotReady) return false;
    check(r, "cudaEventQuery");
    return true;
  });
  m.def("vgpu_event_synchronize", [](uintptr_t e) {
    check(cudaEventSynchronize(as<CUevent_st>(e)), "cudaEventSynchronize");
  }, G());
  m.def("vgpu_begin_capture", [](uintptr_t s, const std::string& mode) {
    check(cudaStreamBeginCapture(as<CUstream_st>(s), parse_mode(mode)), "cudaStreamBeginCapture");
  }, py::arg("stream"), py::arg("mode") = "global");
  m.def("vgpu_end_capture", [](uintptr_t s) {
    cudaGraph_t g = nullptr;
    check(cudaStreamEndCapture(as<CUstream_st>(s), &g), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(g);
    return reinterpret_cast<uintptr_t>(exec);
  });
  m.def("vgpu_graph_launch", [](uintptr_t exec, uintptr_t s) {
    check(cudaGraphLaunch(as<CUgraphExec_st>(exec), as<CUstream_st>(s)), "cudaGraphLaunch");
  }, G());
  m.def("vgpu_graph_destroy", [](uintptr_t exec) { cudaGraphExecDestroy(as<CUgraphExec_st>(exec)); });
  m.def("vgpu_capture_status", [](uintptr_t s) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    check(cudaStreamGetCaptureInfo(as<CUstream_st>(s), &st, &id), "cudaStreamGetCaptureInfo");
    const char* name = st == cudaStreamCaptureStatusNone ? "none"
                       : st == cudaStreamCaptureStatusActive ? "active" : "invalidated";
    return py::make_tuple(name, id);
  });
  m.def("vgpu_exchange_capture_mode", [](const std::string& mode) {
    cudaStreamCaptureMode m = parse_mode(mode);
    check(cudaThreadExchangeStreamCaptureMode(&m), "cudaThreadExchangeStreamCaptureMode");
    return std::string(mode_name(m));
  });
  // Work a test puts on a stream: a copy, and a "slow kernel" that holds the stream.
  m.def("vgpu_memcpy_async", [](uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t s) {
    check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                          cudaMemcpyDeviceToDevice, as<CUstream_st>(s)),
          "cudaMemcpyAsync");
  });
  m.def("vgpu_sleep", [](uintptr_t s, double seconds) {
    check(enqueue(as<CUstream_st>(s),
                  [seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); },
                  "sleep"),
          "enqueue");
  });
  m.def("vgpu_failure", &failure, "the emulated device's sticky fault, '' when none");
  m.attr("VIRTUAL_GPU") = true;
}

}  // namespace vgpu
}  // namespace qcoll
