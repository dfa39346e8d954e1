// Communicator over a raw NCCL communicator (GPU builds only). Buffers are device pointers
// (BufferRef::ptr); work is ordered on the stream of the Device passed with each call.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "qcoll/comm.h"
#include "qcoll/nccl_api.h"

struct CUevent_st;  // cudaEvent_t, without the CUDA headers

namespace qcoll {

// Watchdog (NOT YET RUN on a GPU: compiled only): every NCCL call records an event on its
// stream; a thread per communicator polls the events and ncclCommGetAsyncError every
// 10 ms. When NCCL reports an error, or a call has not completed `timeout_s` after it was
// enqueued, the communicator is aborted (which ends this rank's NCCL kernels and, through
// them, makes the peers' calls fail or time out, so their watchdogs abort too) and every
// later call on it raises with the reason. ncclCommInitRank itself is not bounded.
class NcclCommunicator final : public Communicator {
 public:
  // unique_id: the nccl::kUniqueIdBytes bytes of nccl::nccl_unique_id() from member 0;
  // rank, size, member_is_local as for Communicator; device: CUDA ordinal of the buffers.
  // Collective: every member constructs at once (ncclCommInitRank blocks until all join).
  // timeout_s: how long a call may take on the GPU before the watchdog aborts.
  NcclCommunicator(const std::string& unique_id, int rank, int size,
                   std::vector<bool> member_is_local, int device, double timeout_s);
  // destroy(), errors swallowed: never throws.
  ~NcclCommunicator() override;

  int device() const { return device_; }
  int nccl_version() const { return api_.version; }
  bool uses_call_stream() const override { return true; }
  // ncclCommDestroy (ncclCommAbort after an asynchronous error). NCCL may wait there for
  // the other members on this node: destroy communicators in the same order on every rank.
  // It cannot be used afterwards; a second call does nothing.
  void destroy();
  // Stops in-flight work and frees the communicator without waiting for any peer (after an
  // error, a hang, or at interpreter exit); it cannot be used afterwards.
  void abort();
  bool alive() const { return comm_ != nullptr && !failed_; }
  // Why the watchdog aborted the communicator; "" while it is usable.
  std::string error() const;

 protected:
  void do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                     const Device& dev) override;
  void do_all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device& dev) override;
  void do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype, ReduceOp op,
                         const Device& dev) override;

 private:
  nccl::cudaStream_t stream_of(const Device& dev) const;
  // Records an event after the call just enqueued on `stream`, for the watchdog.
  void watch(const char* what, nccl::cudaStream_t stream);
  void watchdog_loop();
  void stop_watchdog();  // joins the thread and frees the events still pending

  struct Pending {
    CUevent_st* event;
    std::chrono::steady_clock::time_point deadline;
    const char* what;
  };

  const nccl::NcclApi& api_;
  int device_;
  nccl::ncclComm_t comm_ = nullptr;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;  // guards pending_, failure_, stop_
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::string failure_;
  std::atomic<bool> failed_{false};  // the watchdog aborted comm_ (failure_ says why)
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace qcoll
