// The one binding file: Python passes raw pointers (tensor.data_ptr()), sizes, dtype codes
// and a stream handle; no framework header is included, so any framework can call in.
// qcoll::ArgumentError derives from std::invalid_argument, which pybind11 raises as
// ValueError; qcoll::CommunicationError becomes the module's CommunicationError (qcoll's,
// a RuntimeError); other qcoll errors become RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "qcoll/collectives.h"
#include "qcoll/device.h"
#include "qcoll/error.h"
#include "qcoll/kernels.h"
#include "qcoll/nccl_api.h"
#include "qcoll/quant_math.h"
#include "qcoll/wire.h"
#include "qcoll/wire_header.h"
#include "cpu/isa.h"
#include "kernel_bindings.h"
#include "torch_comm.h"
#if defined(QCOLL_WITH_CUDA)
#include "comm/nccl_comm.h"
#include "cuda/device_guard.h"
#endif
#if defined(QCOLL_EMU_STREAMS)
#include "emu/cudart/bindings.h"
#include "emu/runtime.h"
#endif

// qcoll._C, or qcoll._C_emu: the same core built against the emulated CUDA runtime.
#if !defined(QCOLL_MODULE_NAME)
#define QCOLL_MODULE_NAME _C
#endif

namespace py = pybind11;

namespace {

using qcoll::binding::device;
using qcoll::binding::ptr;

// The buffers of one exchange of a call: `buffers` is the call's own buffers object
// (python/qcoll/_runtime/buffers.py), whose `pointers` are indexed by BufferId. The core
// hands it back to the torch transport with every exchange (BufferRef::table); the caller
// keeps it alive for the call. Read with the GIL held.
qcoll::CollectiveBuffers collective_buffers(py::handle buffers) {
  const auto pointers = buffers.attr("pointers").cast<std::vector<uintptr_t>>();
  QCOLL_ARG_CHECK(pointers.size() == qcoll::kBufferCount, "buffers.pointers must hold ",
                  qcoll::kBufferCount, " pointers (ids _C.BUFFERS), got ", pointers.size());
  auto at = [&](qcoll::BufferId id) { return ptr(pointers[static_cast<size_t>(id)]); };
  return qcoll::CollectiveBuffers::of(at(qcoll::BufferId::kInput), at(qcoll::BufferId::kOutput),
                                      at(qcoll::BufferId::kWorkspace), buffers.ptr());
}

py::dict traffic_dict(const qcoll::Traffic& t) {
  py::dict d;
  d["calls"] = t.calls.load();
  d["intra_bytes"] = t.intra_bytes.load();
  d["inter_bytes"] = t.inter_bytes.load();
  d["header_bytes"] = t.header_bytes.load();
  return d;
}

// Adds a call's traffic to the process-wide counters however the call ends (total null:
// a part of a composite call, which Python counts once with add_traffic when it ends).
struct Counted {
  qcoll::Traffic& call;
  qcoll::Traffic* total;
  ~Counted() {
    if (total) total->add(call);
  }
};

// The process-wide counter named `collective` ("" or "none": no counter).
qcoll::Traffic* counter(const std::string& collective) {
  if (collective == "allgather") return &qcoll::allgather_traffic();
  if (collective == "reduce_scatter") return &qcoll::reduce_scatter_traffic();
  if (collective == "all_reduce") return &qcoll::all_reduce_traffic();
  QCOLL_ARG_CHECK(collective.empty() || collective == "none", "collective must be 'allgather', "
                  "'reduce_scatter', 'all_reduce' or 'none', got '", collective, "'");
  return nullptr;
}

void bind_collectives(py::module_& m) {
  using qcoll::Communicator;
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def("is_local", &Communicator::is_local)
      .def_property_readonly("has_all_reduce", &Communicator::has_all_reduce)
      // Counts a call made outside qcoll (torch's own, e.g. FSDP2's default collectives)
      // under qcoll's accounting rule, so baselines and qcoll are measured alike.
      .def("account", [](const Communicator& c, const std::string& collective, int64_t bytes_per_peer) {
        QCOLL_ARG_CHECK(bytes_per_peer >= 0, "bytes_per_peer must be >= 0, got ", bytes_per_peer);
        qcoll::Traffic* t = counter(collective);
        QCOLL_ARG_CHECK(t != nullptr, "collective must name a counter, got '", collective, "'");
        t->calls += 1;
        c.count(bytes_per_peer, *t);
      }, py::arg("collective"), py::arg("bytes_per_peer"));
  py::class_<qcoll::TorchCommunicator, Communicator, std::shared_ptr<qcoll::TorchCommunicator>>(
      m, "TorchCommunicator")
      .def(py::init<int, int, std::vector<bool>, py::object>(), py::arg("rank"), py::arg("size"),
           py::arg("member_is_local"), py::arg("transport"));
#if defined(QCOLL_WITH_CUDA)
  // Construction blocks in ncclCommInitRank until every rank joined: release the GIL.
  py::class_<qcoll::NcclCommunicator, Communicator, std::shared_ptr<qcoll::NcclCommunicator>>(
      m, "NcclCommunicator")
      .def(py::init<const std::string&, int, int, std::vector<bool>, int, double>(),
           py::call_guard<py::gil_scoped_release>(), py::arg("unique_id"), py::arg("rank"),
           py::arg("size"), py::arg("member_is_local"), py::arg("device"), py::arg("timeout_s"))
      .def_property_readonly("error", &qcoll::NcclCommunicator::error)
      .def_property_readonly("device", &qcoll::NcclCommunicator::device)
      .def_property_readonly("nccl_version", &qcoll::NcclCommunicator::nccl_version)
      .def_property_readonly("ops_enqueued", &qcoll::NcclCommunicator::ops_enqueued)
      .def_property_readonly("failed_op", &qcoll::NcclCommunicator::failed_op)
      // Both may wait on NCCL (destroy for the node's other members): release the GIL.
      .def("destroy", &qcoll::NcclCommunicator::destroy, py::call_guard<py::gil_scoped_release>())
      .def("abort", &qcoll::NcclCommunicator::abort, py::call_guard<py::gil_scoped_release>());
  // The id of the CUDA graph capture `stream` is part of, 0 when it is not capturing: each
  // capture owns its workspace (python/qcoll/_runtime/streams.py).
  m.def("cuda_capture_id", [](uintptr_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    QCOLL_CUDA_CHECK(cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream), &status, &id));
    return status == cudaStreamCaptureStatusNone ? 0ULL : id;  // invalidated: still no queries
  }, py::arg("stream"));
#endif
  m.def("nccl_version", &qcoll::nccl::nccl_version_string);
  m.def("nccl_unique_id", [] { return py::bytes(qcoll::nccl::nccl_unique_id()); });

  py::class_<qcoll::ReduceScatterPlan>(m, "ReduceScatterPlan")
      .def_readonly("two_hop", &qcoll::ReduceScatterPlan::two_hop)
      .def_readonly("nodes", &qcoll::ReduceScatterPlan::nodes)
      .def_readonly("n", &qcoll::ReduceScatterPlan::n)
      .def_readonly("stages", &qcoll::ReduceScatterPlan::stages)
      .def_readonly("requested_stages", &qcoll::ReduceScatterPlan::requested_stages)
      .def_readonly("header", &qcoll::ReduceScatterPlan::header)
      .def_readonly("slice", &qcoll::ReduceScatterPlan::slice)
      .def_property_readonly("first_format", [](const qcoll::ReduceScatterPlan& p) { return static_cast<int>(p.first.format); })
      .def_property_readonly("second_format", [](const qcoll::ReduceScatterPlan& p) { return static_cast<int>(p.second.format); })
      .def_property_readonly("encodes_input", &qcoll::ReduceScatterPlan::encodes_input)
      .def_property_readonly("reencodes_partial_sums", &qcoll::ReduceScatterPlan::reencodes_partial_sums)
      .def_property_readonly("transport_reduces", &qcoll::ReduceScatterPlan::transport_reduces)
      .def_property_readonly("sends_input", &qcoll::ReduceScatterPlan::sends_input)
      .def("first_chunk", &qcoll::ReduceScatterPlan::first_chunk)
      .def("second_chunk", &qcoll::ReduceScatterPlan::second_chunk)
      .def("slice_len", &qcoll::ReduceScatterPlan::slice_len)
      .def_property_readonly("workspace_bytes", &qcoll::ReduceScatterPlan::workspace_bytes);
  m.def(
      "plan_reduce_scatter",
      [](int world, int node_size, int64_t n, int dtype, int intra_format, int inter_format,
         int64_t group_size, int stages, int hierarchical, bool headers, int64_t min_stage_bytes,
         int hadamard_size, bool raw_exchange, int64_t call_numel) {
        return qcoll::plan_reduce_scatter(world, node_size, n, static_cast<qcoll::DType>(dtype),
                                          static_cast<qcoll::CodeFormat>(intra_format),
                                          static_cast<qcoll::CodeFormat>(inter_format), group_size,
                                          stages, hierarchical, headers, min_stage_bytes,
                                          hadamard_size, raw_exchange, call_numel);
      },
      py::arg("world"),
        py::arg("node_size"), py::arg("n"), py::arg("dtype"), py::arg("intra_format"),
        py::arg("inter_format"), py::arg("group_size"), py::arg("stages"), py::arg("hierarchical"),
        py::arg("headers") = false, py::arg("min_stage_bytes") = qcoll::kMinPipelineStageBytes,
        py::arg("hadamard_size") = 0, py::arg("raw_exchange") = false, py::arg("call_numel") = -1);
  py::class_<qcoll::AllGatherPlan>(m, "AllGatherPlan")
      .def_property_readonly("chunk", &qcoll::AllGatherPlan::chunk)
      .def_readonly("header", &qcoll::AllGatherPlan::header)
      .def_property_readonly("workspace_bytes", &qcoll::AllGatherPlan::workspace_bytes);
  m.def(
      "plan_all_gather",
      [](int world, int64_t n, int dtype, int format, int64_t group_size, bool headers) {
        return qcoll::plan_all_gather(world, n, static_cast<qcoll::DType>(dtype),
                                      static_cast<qcoll::CodeFormat>(format), group_size, headers);
      },
      py::arg("world"), py::arg("n"),
        py::arg("dtype"), py::arg("format"), py::arg("group_size"), py::arg("headers") = false);

  // One call's own byte counts (a Work's traffic); added to the process-wide counters
  // when the call ends, failed or not.
  py::class_<qcoll::Traffic>(m, "Traffic")
      .def(py::init<>())
      .def("as_dict", &traffic_dict);
  // A composite call (qcoll.quantized_all_reduce): its parts' bytes as one call, added to
  // `call` and to the counter named `collective`.
  m.def("add_traffic", [](qcoll::Traffic& call, const std::vector<qcoll::Traffic*>& parts,
                          const std::string& collective) {
    for (const qcoll::Traffic* part : parts) {
      call.add(*part);
      call.calls -= part->calls.load();
    }
    call.calls += 1;
    if (qcoll::Traffic* total = counter(collective)) total->add(call);
  }, py::arg("call"), py::arg("parts"), py::arg("collective"));

  // The collectives run with the GIL released (a torch transport's exchanges take it back).
  m.def(
      "all_gather",
      [](const qcoll::AllGatherPlan& plan, Communicator& comm, int dtype, py::object buffers,
         int device_kind, int device_index, uintptr_t stream, qcoll::Traffic& traffic,
         uint32_t sequence, const std::string& collective) {
        const qcoll::CollectiveBuffers b = collective_buffers(buffers);
        qcoll::Traffic* total = counter(collective);
        py::gil_scoped_release release;
        Counted counted{traffic, total};
        qcoll::all_gather(plan, b, static_cast<qcoll::DType>(dtype), comm,
                          device(device_kind, device_index, stream), traffic, sequence);
      },
      py::arg("plan"), py::arg("comm"), py::arg("dtype"), py::arg("buffers"),
      py::arg("device_kind"), py::arg("device_index"), py::arg("stream"), py::arg("traffic"),
      py::arg("sequence"), py::arg("collective") = "allgather");
  m.def(
      "reduce_scatter",
      [](const qcoll::ReduceScatterPlan& plan, Communicator& world, Communicator* intra,
         Communicator* inter, int dtype, int op, py::object buffers, int device_kind,
         int device_index, uintptr_t stream, qcoll::Traffic& traffic, uint32_t sequence,
         uintptr_t lane_stream, const std::string& collective, uintptr_t inter_residual) {
        qcoll::CollectiveBuffers b = collective_buffers(buffers);
        b.inter_residual = static_cast<float*>(ptr(inter_residual));
        qcoll::Traffic* total = counter(collective);
        py::gil_scoped_release release;
        Counted counted{traffic, total};
        qcoll::Device dev = device(device_kind, device_index, stream);
        dev.lane_stream = ptr(lane_stream);  // the group's second stream (pipelined 2-hop)
        qcoll::reduce_scatter(plan, b, static_cast<qcoll::DType>(dtype),
                              static_cast<qcoll::ReduceOp>(op), world, intra, inter, dev, traffic,
                              sequence);
      },
      py::arg("plan"), py::arg("world"),
      py::arg("intra").none(true), py::arg("inter").none(true), py::arg("dtype"), py::arg("op"),
      py::arg("buffers"), py::arg("device_kind"),
      py::arg("device_index"), py::arg("stream"), py::arg("traffic"), py::arg("sequence"),
      py::arg("lane_stream") = 0, py::arg("collective") = "reduce_scatter",
      py::arg("inter_residual") = 0);
  m.def(
      "all_reduce_raw",
      // buffers: the values (reduced in place) as the output, the workspace as the workspace.
      [](Communicator& comm, int dtype, int wire, int op, int64_t count, py::object buffers,
         qcoll::Traffic& traffic, uint32_t sequence, int64_t call_numel,
         const std::string& collective) {
        const qcoll::CollectiveBuffers b = collective_buffers(buffers);
        qcoll::Traffic* total = counter(collective);
        py::gil_scoped_release release;
        Counted counted{traffic, total};
        qcoll::all_reduce_raw(count, b, static_cast<qcoll::DType>(dtype),
                              static_cast<qcoll::DType>(wire), static_cast<qcoll::ReduceOp>(op),
                              comm, device(0, 0, 0), traffic, sequence, call_numel);
      },
      py::arg("comm"), py::arg("dtype"), py::arg("wire"),
      py::arg("op"), py::arg("count"), py::arg("buffers"), py::arg("traffic"),
      py::arg("sequence"), py::arg("call_numel"), py::arg("collective") = "all_reduce");
  m.def("stats", []() {
    py::dict d;
    d["allgather"] = traffic_dict(qcoll::allgather_traffic());
    d["reduce_scatter"] = traffic_dict(qcoll::reduce_scatter_traffic());
    d["all_reduce"] = traffic_dict(qcoll::all_reduce_traffic());
    return d;
  });
  m.def("reset_stats", []() {
    qcoll::allgather_traffic().reset();
    qcoll::reduce_scatter_traffic().reset();
    qcoll::all_reduce_traffic().reset();
  });
}

// The code tables, defined once in the core and read by Python (qcoll._dtypes,
// qcoll.formats, collectives): name -> code, and per format what a code is.
py::dict dtype_table() {
  py::dict d;
  for (auto t : {qcoll::DType::kFloat32, qcoll::DType::kFloat16, qcoll::DType::kBFloat16,
                 qcoll::DType::kBytes})
    d[qcoll::dtype_name(t)] = static_cast<int>(t);
  return d;
}

py::dict op_table() {
  py::dict d;
  for (auto op : {qcoll::ReduceOp::kSum, qcoll::ReduceOp::kAvg})
    d[qcoll::reduce_op_name(op)] = static_cast<int>(op);
  return d;
}

py::dict format_table() {
  py::dict d;
  for (auto f : {qcoll::CodeFormat::kInt8, qcoll::CodeFormat::kInt4, qcoll::CodeFormat::kFp8E4M3}) {
    py::dict info;
    info["code"] = static_cast<int>(f);
    info["bits"] = qcoll::code_bits(f);
    info["float"] = qcoll::format_is_float(f);
    info["qmax"] = qcoll::math::qmax_symmetric(f);
    info["asymmetric"] = !qcoll::format_is_float(f);
    d[qcoll::format_name(f)] = info;
  }
  return d;
}

py::dict buffer_table() {
  py::dict d;
  for (auto id : {qcoll::BufferId::kInput, qcoll::BufferId::kOutput, qcoll::BufferId::kWorkspace})
    d[qcoll::buffer_name(id)] = static_cast<int>(id);
  return d;
}

py::dict call_kind_table() {
  py::dict d;
  for (auto k : {qcoll::CallKind::kAllGather, qcoll::CallKind::kReduceScatter, qcoll::CallKind::kAllReduce})
    d[qcoll::call_kind_name(k)] = static_cast<int>(k);
  return d;
}

py::dict rounding_table() {
  py::dict d;
  d["nearest"] = static_cast<int>(qcoll::Rounding::kNearest);
  d["stochastic"] = static_cast<int>(qcoll::Rounding::kStochastic);
  return d;
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
  d["cpu_isa"] = qcoll::cpu::isa_name(qcoll::cpu::active_isa());
  return d;
}

// The CPU kernels' ISA path (cpu/isa.h): which one runs, and forcing one (tests).
std::string cpu_isa() { return qcoll::cpu::isa_name(qcoll::cpu::active_isa()); }

bool set_cpu_isa(const std::string& name) {
  qcoll::cpu::Isa isa;
  QCOLL_ARG_CHECK(qcoll::cpu::parse_isa(name.c_str(), &isa),
                  "cpu isa must be baseline, avx2 or avx512, got ", name);
  return qcoll::cpu::set_isa(isa);
}

}  // namespace

PYBIND11_MODULE(QCOLL_MODULE_NAME, m) {
  // The class qcoll.CommunicationError is: the Python transports raise it as well.
  auto& communication_error =
      py::register_exception<qcoll::CommunicationError>(m, "CommunicationError", PyExc_RuntimeError);
  communication_error.attr("__module__") = "qcoll";
  m.doc() = "qcoll core kernels (raw-pointer interface; use the qcoll package instead)";
  qcoll::binding::bind_kernels(
      m, [](const auto& args, auto entry) { entry(args); }, /*release_gil=*/true);
  m.def("build_info", &build_info);
  m.def("cpu_isa", &cpu_isa, "the ISA path the CPU kernels take: baseline, avx2 or avx512");
  m.def("cpu_isa_best", [] { return std::string(qcoll::cpu::isa_name(qcoll::cpu::best_isa())); },
        "the widest path this CPU supports (capped by QCOLL_CPU_ISA)");
  m.def("set_cpu_isa", &set_cpu_isa,
        "force the CPU kernels' ISA path; False (nothing changed) where the CPU lacks it");
  m.def("set_openmp_threads", &qcoll::set_openmp_threads, py::arg("threads"),
        "Sets the calling thread's OpenMP team size; returns the previous one.");
  m.def("openmp_threads", &qcoll::openmp_max_threads, "The calling thread's OpenMP team size.");
  // The process environment as getenv sees it (os.environ's writes reach it through
  // putenv): one C call per collective for QCOLL_DEBUG, where os.environ.get runs three
  // Python frames.
  m.def(
      "env_flag",
      [](const std::string& name) {
        const char* value = std::getenv(name.c_str());
        return value != nullptr && value[0] != '\0' && std::string(value) != "0";
      },
      py::arg("name"), "Whether the environment variable is set to something other than '' or '0'.");
  bind_collectives(m);
  m.attr("GROUP_SIZE_MULTIPLE") = qcoll::kGroupSizeMultiple;
  m.attr("MAX_GROUP_SIZE") = qcoll::kMaxGroupSize;
  m.attr("MIN_HADAMARD_SIZE") = qcoll::kMinHadamardSize;
  m.attr("MAX_HADAMARD_SIZE") = qcoll::kMaxHadamardSize;
  m.attr("MIN_PIPELINE_STAGE_BYTES") = qcoll::kMinPipelineStageBytes;
  m.attr("WIRE_HEADER_BYTES") = qcoll::kHeaderBytes;
  m.attr("CALL_HEADER_BYTES") = qcoll::kCallHeaderBytes;
  m.attr("DTYPES") = dtype_table();
  m.attr("DEVICE_KINDS") = py::dict(py::arg("cpu") = static_cast<int>(qcoll::DeviceKind::kCPU),
                                    py::arg("cuda") = static_cast<int>(qcoll::DeviceKind::kCUDA));
  m.attr("OPS") = op_table();
  m.attr("FORMATS") = format_table();
  m.attr("RAW_FORMAT") = static_cast<int>(qcoll::CodeFormat::kRaw);
  m.attr("ROUNDINGS") = rounding_table();
  m.attr("BUFFERS") = buffer_table();
  m.attr("CALL_KINDS") = call_kind_table();
#if defined(QCOLL_EMU_STREAMS)
  qcoll::emu::Config emu_config;
  emu_config.any_global = true;  // the buffers are torch's allocations: see emu/runtime.h
  qcoll::emu::configure(emu_config);
  qcoll::vgpu::bind_virtual_gpu(m);
#endif
}
