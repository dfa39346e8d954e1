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
  // ncclCommDestroy (ncclCommAbort after an asynchronous error); never throws. NCCL may
  // wait there for the other members on this node: drop communicators in the same order
  // on every rank.
  ~NcclCommunicator() override;

  int device() const { return device_; }
  int nccl_version() const { return api_.version; }
  bool uses_call_stream() const override { return true; }
  // Stops in-flight work and frees the communicator (after an error or a hang); it cannot
  // be used afterwards.
  void abort();

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
