// Communicator over a raw NCCL communicator (GPU builds only). Buffers are device pointers
// (BufferRef::ptr); work is ordered on the stream of the Device passed with each call.
#pragma once

#include <string>
#include <vector>

#include "qcoll/comm.h"
#include "qcoll/nccl_api.h"

namespace qcoll {

class NcclCommunicator final : public Communicator {
 public:
  // unique_id: the nccl::kUniqueIdBytes bytes of nccl::nccl_unique_id() from member 0;
  // rank, size, member_is_local as for Communicator; device: CUDA ordinal of the buffers.
  // Collective: every member constructs at once (ncclCommInitRank blocks until all join).
  NcclCommunicator(const std::string& unique_id, int rank, int size,
                   std::vector<bool> member_is_local, int device);
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
  bool alive() const { return comm_ != nullptr; }

 protected:
  void do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                     const Device& dev) override;
  void do_all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device& dev) override;
  void do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype, ReduceOp op,
                         const Device& dev) override;

 private:
  nccl::cudaStream_t stream_of(const Device& dev) const;

  const nccl::NcclApi& api_;
  int device_;
  nccl::ncclComm_t comm_ = nullptr;
};

}  // namespace qcoll
