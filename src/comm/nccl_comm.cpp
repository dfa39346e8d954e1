// Raw-NCCL transport: all-to-all as grouped send/recv, NCCL's own all-gather and
// reduce-scatter. Every NCCL call is checked; errors carry NCCL's message and file:line.
#include "comm/nccl_comm.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <utility>

#include "cuda/device_guard.h"

namespace qcoll {

using namespace nccl;

namespace {

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

namespace {
constexpr auto kPollInterval = std::chrono::milliseconds(10);  // the watchdog's period
// An NCCL call in progress (from NCCL 2.22 every call on a nonblocking communicator may
// report it) usually settles within microseconds: poll with yields this long, then sleep,
// doubling from kFirstSleep up to kMaxSleep (init and finalize can take seconds).
constexpr auto kSpinFor = std::chrono::microseconds(20);
constexpr auto kFirstSleep = std::chrono::microseconds(10);
constexpr auto kMaxSleep = std::chrono::microseconds(1000);
using Clock = std::chrono::steady_clock;

// Lets this thread query events recorded outside any capture while it, or another thread,
// captures a CUDA graph (a failure found during an enqueue inside a capture), as torch's
// CUDAStreamCaptureModeGuard does.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};
}  // namespace

// Holds call_mu_ while one call is enqueued; refuses a destroyed or failed communicator and
// buffers on another device. Its destructor aborts a communicator that failed during the
// call, after every NCCL group of the call was closed (the Group objects live inside it).
class NcclCommunicator::Enqueue {
 public:
  Enqueue(NcclCommunicator& c, const Device& dev) : c_(c), lock_(c.call_mu_) {
    QCOLL_CHECK(c_.comm_ != nullptr, "NCCL communicator was destroyed or aborted");
    if (c_.failed_) throw CommunicationError(c_.error());
    QCOLL_ARG_CHECK(dev.kind == DeviceKind::kCUDA && dev.index == c_.device_,
                    "NCCL communicator of cuda:", c_.device_, " got buffers on ",
                    dev.kind == DeviceKind::kCUDA ? "cuda:" : "cpu:", dev.index);
    stream_ = static_cast<cudaStream_t>(dev.stream);
  }
  ~Enqueue() {
    if (c_.failed_) c_.abort_locked();
  }
  Enqueue(const Enqueue&) = delete;
  Enqueue& operator=(const Enqueue&) = delete;
  cudaStream_t stream() const { return stream_; }

 private:
  NcclCommunicator& c_;
  std::lock_guard<std::mutex> lock_;
  cudaStream_t stream_ = nullptr;
};

// ncclGroupStart/End pair; the destructor closes a group left open by a failed call, so
// NCCL's group depth stays balanced (and no queued operation outlives an abort).
class NcclCommunicator::Group {
 public:
  explicit Group(NcclCommunicator& c) : c_(c) {
    c_.settle(c_.api_.ncclGroupStart(), "ncclGroupStart()", __FILE__, __LINE__);
  }
  void end() {
    open_ = false;
    c_.settle(c_.api_.ncclGroupEnd(), "ncclGroupEnd()", __FILE__, __LINE__);
  }
  ~Group() {
    if (open_) c_.api_.ncclGroupEnd();
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

 private:
  NcclCommunicator& c_;
  bool open_ = true;
};

#define QCOLL_NCCL_ENQUEUE(expr) settle((expr), #expr, __FILE__, __LINE__)

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
  QCOLL_CHECK(api_.ncclCommInitRankConfig && api_.ncclCommFinalize, "NCCL ",
              nccl_version_name(api_.version), " at ", api_.path,
              " lacks ncclCommInitRankConfig/ncclCommFinalize: qcoll needs NCCL >= 2.14 to "
              "create communicators whose setup is bounded by the group's timeout");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  cuda::DeviceGuard guard(device_);  // NCCL binds the communicator to the current device
  ncclConfigV21400 config;
  config.blocking = 0;  // returns at once; joining the peers is polled below, bounded
  const auto deadline = Clock::now() + timeout_;
  ncclResult_t r = api_.ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  if (r == ncclInProgress && comm_) r = wait_settled(deadline);
  if (r != ncclSuccess) {
    // A failed or unfinished init may still hand back a communicator: abort frees it (the
    // destructor does not run for a throwing constructor).
    std::string why;
    if (r == ncclInProgress) {
      std::ostringstream os;
      os << "ncclCommInitRankConfig: the " << size << " members did not all join within the "
         << "timeout of " << timeout_.count() / 1000.0
         << " s (a peer died, hangs or never created its communicator) [" << __FILE__ << ":"
         << __LINE__ << "]";
      why = os.str();
    } else {
      try {
        nccl_fail(r, "ncclCommInitRankConfig", __FILE__, __LINE__, comm_);
      } catch (const Error& e) {
        why = e.what();
      }
    }
    if (comm_) api_.ncclCommAbort(comm_);
    comm_ = nullptr;
    throw CommunicationError(why);
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

ncclResult_t NcclCommunicator::wait_settled(Clock::time_point deadline) const {
  const auto spin_until = Clock::now() + kSpinFor;
  auto sleep = kFirstSleep;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = api_.ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) return q;
    if (state != ncclInProgress) return state;
    const auto now = Clock::now();
    if (now > deadline || abandoned_.load()) return ncclInProgress;
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, kMaxSleep);
    }
  }
}

void NcclCommunicator::settle(ncclResult_t result, const char* expr, const char* file,
                              int line) {
  if (result == ncclInProgress) result = wait_settled(Clock::now() + timeout_);
  if (result == ncclSuccess) return;
  std::string why;
  if (result == ncclInProgress) {
    std::ostringstream os;
    os << expr << " was still in progress after the timeout of " << timeout_.count() / 1000.0
       << " s [" << file << ":" << line << "]";
    why = os.str();
  } else {
    try {
      nccl_fail(result, expr, file, line, comm_);
    } catch (const Error& e) {
      why = e.what();
    }
  }
  record_failure(why);
  throw CommunicationError(error());
}

void NcclCommunicator::record_failure(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  {
    RelaxedCaptureMode relaxed;
    pop_completed_locked();  // a query error only makes the failure start earlier
  }
  // The abort that follows ends every operation still pending: the failure starts at the
  // first one (or at the one being enqueued when nothing is pending).
  failed_op_ = pending_.empty() ? ops_enqueued_ : pending_.front().op;
  failure_ = "NCCL communicator aborted: " + why;
  failed_ = true;
}

ncclResult_t NcclCommunicator::abort_locked() {
  if (aborted_ || !comm_) return ncclSuccess;
  aborted_ = true;
  return api_.ncclCommAbort(comm_);
}

void NcclCommunicator::watch(const char* what, cudaStream_t stream) {
  // A call captured into a CUDA graph runs at replay: nothing to time now, and a captured
  // event cannot be queried.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  QCOLL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  cudaEvent_t event = nullptr;
  QCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, stream);
  if (recorded != cudaSuccess) cudaEventDestroy(event);
  QCOLL_CUDA_CHECK(recorded);
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(Pending{event, Clock::now() + timeout_, what, ops_enqueued_++});
}

std::string NcclCommunicator::pop_completed_locked() {
  while (!pending_.empty()) {
    const Pending& p = pending_.front();
    const cudaError_t q = cudaEventQuery(p.event);
    if (q == cudaErrorNotReady) break;  // in order: later calls cannot have completed first
    if (q != cudaSuccess)
      return std::string("CUDA error while waiting for NCCL ") + p.what + ": " +
             cudaGetErrorString(q);
    cudaEventDestroy(p.event);
    pending_.pop_front();
  }
  return "";
}

std::string NcclCommunicator::check_progress() {
  std::lock_guard<std::mutex> lock(mu_);
  // Completed calls first: an error found below fails only the calls still pending.
  std::string why = pop_completed_locked();
  if (!why.empty()) return why;
  ncclResult_t async = ncclSuccess;
  if (api_.ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
      async != ncclInProgress)
    return std::string("NCCL reported an asynchronous error: ") + api_.ncclGetErrorString(async);
  if (!pending_.empty() && Clock::now() > pending_.front().deadline) {
    std::ostringstream os;
    os << "NCCL " << pending_.front().what << " did not complete within the timeout of "
       << timeout_.count() / 1000.0 << " s (a peer died, hangs or never made the call)";
    return os.str();
  }
  return "";
}

void NcclCommunicator::watchdog_loop() {
  // This thread captures nothing; its event queries must neither be refused nor invalidate
  // a CUDA graph another thread captures in the default (global) mode. torch's NCCL
  // watchdog does the same.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  cudaThreadExchangeStreamCaptureMode(&mode);
  try {
    cuda::DeviceGuard guard(device_);
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (wake_.wait_for(lock, kPollInterval, [this] { return stop_; })) return;
      }
      // A call being enqueued holds call_mu_ and checks NCCL itself: look again next tick.
      std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
      if (!call.owns_lock()) continue;
      if (failed_ || !comm_) return;
      const std::string why = check_progress();
      if (why.empty()) continue;
      // Abort ends this rank's NCCL kernels (the pending events then complete); the
      // communicator stays unusable and every later call raises `why`.
      record_failure(why);
      abort_locked();
      return;
    }
  } catch (...) {
    // No CUDA context for this thread (process exit): nothing left to watch.
  }
}

void NcclCommunicator::stop_watchdog() {
  std::lock_guard<std::mutex> stopping(stop_mu_);  // one join, whichever thread comes first
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (const Pending& p : pending_) cudaEventDestroy(p.event);
  pending_.clear();
}

std::string NcclCommunicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

int64_t NcclCommunicator::ops_enqueued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_enqueued_;
}

int64_t NcclCommunicator::failed_op() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_op_;
}

NcclCommunicator::~NcclCommunicator() {
  try {
    destroy();
  } catch (...) {
    // No CUDA any more (process exit), or NCCL failed: its resources go with the process.
  }
}

void NcclCommunicator::destroy() {
  // A dropped Group's communicator is destroyed on a thread of its own (python/qcoll/
  // _nccl.py), at any time: its CUDA calls must not invalidate a graph another thread
  // captures in the default (global) mode, as the watchdog's must not.
  RelaxedCaptureMode relaxed;
  stop_watchdog();
  std::lock_guard<std::mutex> call(call_mu_);
  if (!comm_) return;
  cuda::DeviceGuard guard(device_);
  ncclResult_t r = ncclSuccess;
  if (!failed_) {
    // Finalize flushes the queued work and meets the node's other members; nonblocking, so
    // it is bounded like everything else: past the timeout, abort instead.
    r = api_.ncclCommFinalize(comm_);
    if (r == ncclInProgress) r = wait_settled(Clock::now() + timeout_);
  }
  if (failed_ || r != ncclSuccess) {
    abort_locked();  // after an error, or a finalize that did not settle: nothing to wait for
    comm_ = nullptr;
    return;
  }
  ncclComm_t c = comm_;
  comm_ = nullptr;  // unusable from here on, even if NCCL reports an error below
  // After finalize, destroy only frees this rank's resources; ncclInProgress (nothing left
  // to poll on a freed communicator) is not an error.
  r = api_.ncclCommDestroy(c);
  if (r != ncclSuccess && r != ncclInProgress) nccl_fail(r, "ncclCommDestroy", __FILE__, __LINE__);
}

void NcclCommunicator::abort() {
  abandoned_ = true;  // a destroy() waiting for the peers' finalize (holding call_mu_) gives up
  RelaxedCaptureMode relaxed;  // as in destroy()
  stop_watchdog();
  std::lock_guard<std::mutex> call(call_mu_);
  if (!comm_) return;
  const ncclResult_t r = abort_locked();
  comm_ = nullptr;
  QCOLL_NCCL_CHECK(r);
}

void NcclCommunicator::do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                                     const Device& dev) {
  Enqueue call(*this, dev);
  const cudaStream_t stream = call.stream();
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
  {
    // One group: all sends and receives progress together (no ordering deadlock).
    Group group(*this);
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) continue;
      const size_t off = n * static_cast<size_t>(p);
      QCOLL_NCCL_ENQUEUE(api_.ncclSend(s + off, n, ncclUint8, p, comm_, stream));
      QCOLL_NCCL_ENQUEUE(api_.ncclRecv(r + off, n, ncclUint8, p, comm_, stream));
    }
    group.end();
  }
  watch("all-to-all", stream);
}

void NcclCommunicator::do_all_gather(BufferRef send, BufferRef recv, int64_t bytes,
                                     const Device& dev) {
  Enqueue call(*this, dev);
  const cudaStream_t stream = call.stream();
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device_);
  QCOLL_NCCL_ENQUEUE(api_.ncclAllGather(send.ptr, recv.ptr, static_cast<size_t>(bytes),
                                        ncclUint8, comm_, stream));
  watch("all-gather", stream);
}

void NcclCommunicator::do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count,
                                         DType dtype, ReduceOp op, const Device& dev) {
  const ncclDataType_t type = nccl_type(dtype);
  // ncclAvg (and bfloat16) arrived in NCCL 2.10; older libraries would reject them with a
  // less helpful "invalid argument".
  QCOLL_CHECK(api_.version >= kVersionWithAvg ||
                  (op == ReduceOp::kSum && dtype != DType::kBFloat16),
              "NCCL ", nccl_version_name(api_.version), " at ", api_.path,
              " has no ", op == ReduceOp::kAvg ? "average" : "bfloat16",
              " reduction; qcoll needs NCCL >= 2.10 for it");
  Enqueue call(*this, dev);
  const cudaStream_t stream = call.stream();
  if (count == 0) return;
  const ncclRedOp_t nop = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
  cuda::DeviceGuard guard(device_);
  QCOLL_NCCL_ENQUEUE(api_.ncclReduceScatter(send.ptr, recv.ptr, static_cast<size_t>(count),
                                            type, nop, comm_, stream));
  watch("reduce-scatter", stream);
}

}  // namespace qcoll
