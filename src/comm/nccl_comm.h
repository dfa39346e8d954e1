// Communicator over a raw NCCL communicator (GPU builds only). Buffers are device pointers
// (BufferRef::ptr); work is ordered on the stream of the Device passed with each call.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "qcoll/comm.h"
#include "qcoll/nccl_api.h"

struct CUevent_st;  // cudaEvent_t, without the CUDA headers

namespace qcoll {

// Bounded in time everywhere (run on a lent H200 and H100: a dead peer, an init never
// joined; and under the virtual GPU in every CI run). The communicator is
// created nonblocking (ncclCommInitRankConfig, blocking = 0): creation, every enqueue that
// NCCL reports as in progress and the finalize of destroy() are polled with
// ncclCommGetAsyncError until they settle or `timeout_s` passes; then the communicator is
// aborted and the call throws. Watchdog: every NCCL call records an event on its stream
// (not while the stream is being captured into a CUDA graph: a captured call runs when the
// graph is replayed); a thread per communicator polls the events and ncclCommGetAsyncError
// every 10 ms. When NCCL reports an error, or a call has not completed `timeout_s` after it
// was enqueued, the communicator is aborted (which ends this rank's NCCL kernels and,
// through them, makes the peers' calls fail or time out, so their watchdogs abort too) and
// every later call on it raises with the reason, which error() returns; failed_op() tells
// which enqueued calls the failure covers (a call that had completed did not fail).
class NcclCommunicator final : public Communicator {
 public:
  // unique_id: the nccl::kUniqueIdBytes bytes of nccl::nccl_unique_id() from member 0;
  // rank, size, member_is_local as for Communicator; device: CUDA ordinal of the buffers.
  // Collective: every member constructs at once; throws (on every member that got here)
  // when the members have not all joined within timeout_s. timeout_s also bounds every
  // call on the GPU (the watchdog) and destroy().
  NcclCommunicator(const std::string& unique_id, int rank, int size,
                   std::vector<bool> member_is_local, int device, double timeout_s);
  // destroy(), errors swallowed: never throws.
  ~NcclCommunicator() override;

  int device() const { return device_; }
  int nccl_version() const { return api_.version; }
  bool uses_call_stream() const override { return true; }
  // ncclCommFinalize + ncclCommDestroy (ncclCommAbort after an error, or when finalize has
  // not settled within the timeout). Finalize may wait for the other members on this node:
  // destroy communicators in the same order on every rank. It cannot be used afterwards; a
  // second call does nothing.
  void destroy();
  // Stops in-flight work and frees the communicator without waiting for any peer (after an
  // error, a hang, or at interpreter exit); it cannot be used afterwards. A destroy() still
  // waiting on another thread (for the peers' finalize) stops waiting and aborts.
  void abort();
  // Why the watchdog aborted the communicator; "" while it is usable.
  std::string error() const;
  // Operations enqueued under the watchdog so far (not those captured into a CUDA graph),
  // numbered 0, 1, ... in enqueue (= stream) order.
  int64_t ops_enqueued() const;
  // Once error() is set: the number of the first operation that failed (every one from it on
  // was aborted; the ones before it had completed); -1 while the communicator is usable.
  int64_t failed_op() const;

 protected:
  void do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                     const Device& dev) override;
  void do_all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device& dev) override;
  void do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype, ReduceOp op,
                         const Device& dev) override;

 private:
  class Enqueue;  // holds call_mu_ while a call is enqueued (nccl_comm.cpp)
  class Group;    // ncclGroupStart/End

  // Polls ncclCommGetAsyncError until comm_ leaves ncclInProgress or `deadline` passes (or
  // abort() is called); returns the last state (ncclInProgress when it stopped waiting).
  nccl::ncclResult_t wait_settled(std::chrono::steady_clock::time_point deadline) const;
  // The result of an NCCL call on comm_ (call_mu_ held): ncclInProgress is polled until it
  // settles; an error or the timeout marks the communicator failed and throws (Enqueue's
  // destructor then aborts it, after any open NCCL group was closed).
  void settle(nccl::ncclResult_t result, const char* expr, const char* file, int line);
  // Records why the communicator failed and from which operation on (the first reason
  // wins); call_mu_ held.
  void record_failure(const std::string& why);
  // ncclCommAbort once (call_mu_ held); returns its result.
  nccl::ncclResult_t abort_locked();
  // Records an event after the call just enqueued on `stream`, for the watchdog.
  void watch(const char* what, nccl::cudaStream_t stream);
  void watchdog_loop();
  // Why the communicator must be aborted now ("" if it is healthy); call_mu_ held.
  std::string check_progress();
  // Drops the completed events at the front of pending_ (mu_ held); a query's CUDA error,
  // or "".
  std::string pop_completed_locked();
  void stop_watchdog();  // joins the thread and frees the events still pending

  struct Pending {
    CUevent_st* event;
    std::chrono::steady_clock::time_point deadline;
    const char* what;
    int64_t op;  // its number (ops_enqueued())
  };

  const nccl::NcclApi& api_;
  int device_;
  nccl::ncclComm_t comm_ = nullptr;
  std::chrono::milliseconds timeout_;
  // Lock order: call_mu_, then mu_. call_mu_ serializes every use of comm_ (enqueues, the
  // watchdog's checks, abort, destroy), so comm_ is never aborted under a caller's feet.
  mutable std::mutex call_mu_;
  mutable std::mutex mu_;  // guards pending_, failure_, ops_enqueued_, failed_op_, stop_
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::string failure_;
  int64_t ops_enqueued_ = 0;
  int64_t failed_op_ = -1;
  std::atomic<bool> failed_{false};  // comm_ failed (failure_ says why); it is, or is about to be, aborted
  bool aborted_ = false;             // ncclCommAbort was called (call_mu_)
  bool stop_ = false;
  std::atomic<bool> abandoned_{false};  // abort() was called: wait_settled stops waiting
  // destroy() and abort() may stop the watchdog from two threads; never taken with call_mu_
  // or mu_ held (stop_watchdog() runs before either).
  std::mutex stop_mu_;
  std::thread watchdog_;
};

}  // namespace qcoll
