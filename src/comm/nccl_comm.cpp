// Raw-NCCL transport: all-to-all as grouped send/recv, NCCL's own all-gather and
// reduce-scatter. Every NCCL call is checked; errors carry NCCL's message and file:line.
#include "comm/nccl_comm.h"

#include <cstring>
#include <sstream>
#include <utility>

#include "cuda/cuda_check.h"

namespace qcoll {

using namespace nccl;

namespace {

// ncclGroupStart/End pair; the destructor closes a group left open by a failed call, so
// NCCL's group depth stays balanced for the next collective.
class Group {
 public:
  Group(const NcclApi& api, ncclComm_t comm) : api_(api), comm_(comm) {
    QCOLL_NCCL_CHECK_COMM(api_.ncclGroupStart(), comm_);
  }
  void end() {
    open_ = false;
    QCOLL_NCCL_CHECK_COMM(api_.ncclGroupEnd(), comm_);
  }
  ~Group() {
    if (open_) api_.ncclGroupEnd();
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

 private:
  const NcclApi& api_;
  ncclComm_t comm_;
  bool open_ = true;
};

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kBytes: break;  // raw bytes are never reduced
  }
  throw ArgumentError("NCCL reduce_scatter: unknown dtype code " +
                      std::to_string(static_cast<int>(t)));
}

}  // namespace

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int rank, int size,
                                   std::vector<bool> member_is_local, int device,
                                   double timeout_s)
    : Communicator(rank, size, std::move(member_is_local)),
      api_(nccl_api()),
      device_(device),
      timeout_(static_cast<int64_t>(timeout_s * 1000.0)) {
  QCOLL_ARG_CHECK(timeout_s > 0, "NCCL communicator timeout must be > 0 seconds, got ",
                  timeout_s);
  QCOLL_ARG_CHECK(unique_id.size() == static_cast<size_t>(kUniqueIdBytes),
                  "NCCL unique id must be ", kUniqueIdBytes, " bytes, got ", unique_id.size());
  QCOLL_ARG_CHECK(device >= 0, "NCCL communicator device index ", device, " < 0");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  cuda::DeviceGuard guard(device_);  // NCCL binds the communicator to the current device
  const ncclResult_t r = api_.ncclCommInitRank(&comm_, size, id, rank);
  if (r != ncclSuccess) {
    // A failed init may still hand back a communicator in error state: abort frees it
    // (the destructor does not run for a throwing constructor).
    try {
      nccl_fail(r, "ncclCommInitRank", __FILE__, __LINE__, comm_);
    } catch (...) {
      if (comm_) api_.ncclCommAbort(comm_);
      comm_ = nullptr;
      throw;
    }
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

namespace {
constexpr auto kPollInterval = std::chrono::milliseconds(10);
}

void NcclCommunicator::watch(const char* what, cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  QCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, stream);
  if (recorded != cudaSuccess) cudaEventDestroy(event);
  QCOLL_CUDA_CHECK(recorded);
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(Pending{event, std::chrono::steady_clock::now() + timeout_, what});
}

void NcclCommunicator::watchdog_loop() {
  try {
    cuda::DeviceGuard guard(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_ && !failed_) {
      wake_.wait_for(lock, kPollInterval);
      if (stop_) break;
      std::string why;
      ncclResult_t async = ncclSuccess;
      if (api_.ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress)
        why = std::string("NCCL reported an asynchronous error: ") + api_.ncclGetErrorString(async);
      while (why.empty() && !pending_.empty()) {
        const Pending& p = pending_.front();
        const cudaError_t q = cudaEventQuery(p.event);
        if (q == cudaSuccess) {
          cudaEventDestroy(p.event);
          pending_.pop_front();
        } else if (q != cudaErrorNotReady) {
          why = std::string("CUDA error while waiting for NCCL ") + p.what + ": " +
                cudaGetErrorString(q);
        } else if (std::chrono::steady_clock::now() > p.deadline) {
          std::ostringstream os;
          os << "NCCL " << p.what << " did not complete within the timeout of "
             << timeout_.count() / 1000.0 << " s (a peer died, hangs or never made the call)";
          why = os.str();
        } else {
          break;  // in order: later calls cannot have completed first
        }
      }
      if (why.empty()) continue;
      // Abort ends this rank's NCCL kernels (the pending events then complete); the
      // communicator stays unusable and every later call raises `why`.
      failure_ = "NCCL communicator aborted: " + why;
      failed_ = true;
      api_.ncclCommAbort(comm_);
    }
  } catch (...) {
    // No CUDA context for this thread (process exit): nothing left to watch.
  }
}

void NcclCommunicator::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  for (const Pending& p : pending_) cudaEventDestroy(p.event);
  pending_.clear();
}

std::string NcclCommunicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

NcclCommunicator::~NcclCommunicator() {
  try {
    destroy();
  } catch (...) {
    // No CUDA any more (process exit), or NCCL failed: its resources go with the process.
  }
}

void NcclCommunicator::destroy() {
  if (!comm_) return;
  stop_watchdog();
  ncclComm_t c = comm_;
  comm_ = nullptr;  // unusable from here on, even if NCCL reports an error below
  if (failed_) return;  // the watchdog aborted it: nothing left to free
  cuda::DeviceGuard guard(device_);
  ncclResult_t async = ncclSuccess;
  api_.ncclCommGetAsyncError(c, &async);
  // Destroy waits for queued work, which never ends once a peer failed: abort instead.
  if (async != ncclSuccess)
    QCOLL_NCCL_CHECK(api_.ncclCommAbort(c));
  else
    QCOLL_NCCL_CHECK(api_.ncclCommDestroy(c));
}

void NcclCommunicator::abort() {
  if (!comm_) return;
  stop_watchdog();
  ncclComm_t c = comm_;
  comm_ = nullptr;
  if (failed_) return;  // the watchdog aborted it already
  QCOLL_NCCL_CHECK(api_.ncclCommAbort(c));
}

cudaStream_t NcclCommunicator::stream_of(const Device& dev) const {
  QCOLL_CHECK(comm_ != nullptr, "NCCL communicator was destroyed or aborted");
  if (failed_) throw Error(error());
  QCOLL_ARG_CHECK(dev.kind == DeviceKind::kCUDA && dev.index == device_,
                  "NCCL communicator of cuda:", device_, " got buffers on ",
                  dev.kind == DeviceKind::kCUDA ? "cuda:" : "cpu:", dev.index);
  return static_cast<cudaStream_t>(dev.stream);
}

void NcclCommunicator::do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                                     const Device& dev) {
  const cudaStream_t stream = stream_of(dev);
  if (bytes_per_peer == 0) return;
  cuda::DeviceGuard guard(device_);
  const size_t n = static_cast<size_t>(bytes_per_peer);
  const char* s = static_cast<const char*>(send.ptr);
  char* r = static_cast<char*>(recv.ptr);
  const size_t self = n * static_cast<size_t>(rank());
  // Own block: a device copy on the same stream rather than a send to self through NCCL.
  if (s != r)
    QCOLL_CUDA_CHECK(cudaMemcpyAsync(r + self, s + self, n, cudaMemcpyDeviceToDevice, stream));
  if (size() == 1) return;
  // One group: all sends and receives progress together (no ordering deadlock).
  Group group(api_, comm_);
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    const size_t off = n * static_cast<size_t>(p);
    QCOLL_NCCL_CHECK_COMM(api_.ncclSend(s + off, n, ncclUint8, p, comm_, stream), comm_);
    QCOLL_NCCL_CHECK_COMM(api_.ncclRecv(r + off, n, ncclUint8, p, comm_, stream), comm_);
  }
  group.end();
  watch("all-to-all", stream);
}

void NcclCommunicator::do_all_gather(BufferRef send, BufferRef recv, int64_t bytes,
                                     const Device& dev) {
  const cudaStream_t stream = stream_of(dev);
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device_);
  QCOLL_NCCL_CHECK_COMM(api_.ncclAllGather(send.ptr, recv.ptr, static_cast<size_t>(bytes),
                                           ncclUint8, comm_, stream),
                        comm_);
  watch("all-gather", stream);
}

void NcclCommunicator::do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count,
                                         DType dtype, ReduceOp op, const Device& dev) {
  const cudaStream_t stream = stream_of(dev);
  const ncclDataType_t type = nccl_type(dtype);
  // ncclAvg (and bfloat16) arrived in NCCL 2.10; older libraries would reject them with a
  // less helpful "invalid argument".
  QCOLL_CHECK(api_.version >= kVersionWithAvg ||
                  (op == ReduceOp::kSum && dtype != DType::kBFloat16),
              "NCCL ", nccl_version_name(api_.version), " at ", api_.path,
              " has no ", op == ReduceOp::kAvg ? "average" : "bfloat16",
              " reduction; qcoll needs NCCL >= 2.10 for it");
  if (count == 0) return;
  const ncclRedOp_t nop = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
  cuda::DeviceGuard guard(device_);
  QCOLL_NCCL_CHECK_COMM(api_.ncclReduceScatter(send.ptr, recv.ptr, static_cast<size_t>(count),
                                               type, nop, comm_, stream),
                        comm_);
  watch("reduce-scatter", stream);
}

}  // namespace qcoll
