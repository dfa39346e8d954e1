// Argument checks and traffic accounting shared by every transport.
#include "qcoll/comm.h"

#include "qcoll/error.h"

namespace qcoll {

Communicator::Communicator(int rank, int size, std::vector<bool> member_is_local)
    : rank_(rank), size_(size), member_is_local_(std::move(member_is_local)) {
  QCOLL_ARG_CHECK(size >= 1 && rank >= 0 && rank < size, "communicator rank ", rank,
                  " is not in [0, ", size, ")");
  QCOLL_ARG_CHECK(static_cast<int>(member_is_local_.size()) == size,
                  "member_is_local has ", member_is_local_.size(), " entries for ", size,
                  " members");
  for (int p = 0; p < size; ++p)
    if (p != rank && member_is_local_[p]) ++local_peers_;
}

void Communicator::count(int64_t bytes_per_peer, Traffic& traffic) const {
  const int remote = size_ - 1 - local_peers_;
  traffic.intra_bytes += bytes_per_peer * local_peers_;
  traffic.inter_bytes += bytes_per_peer * remote;
}

bool Communicator::agreed(const std::string& signature) const {
  std::lock_guard<std::mutex> lock(agreed_mutex_);
  return agreed_.count(signature) > 0;
}

void Communicator::add_agreed(const std::string& signature) {
  std::lock_guard<std::mutex> lock(agreed_mutex_);
  if (agreed_.size() >= 4096) agreed_.clear();  // bounded: forgotten ones are checked again
  agreed_.insert(signature);
}

void Communicator::all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                              const Device& dev, Traffic& traffic) {
  QCOLL_CHECK(bytes_per_peer >= 0, "all_to_all of ", bytes_per_peer, " bytes");
  count(bytes_per_peer, traffic);
  do_all_to_all(send, recv, bytes_per_peer, dev);
}

void Communicator::all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device& dev,
                              Traffic& traffic) {
  QCOLL_CHECK(bytes >= 0, "all_gather of ", bytes, " bytes");
  count(bytes, traffic);
  do_all_gather(send, recv, bytes, dev);
}

void Communicator::exchange_call_headers(BufferRef send, BufferRef recv, int64_t bytes,
                                         const Device& dev, Traffic& traffic) {
  QCOLL_CHECK(bytes >= 0, "call header exchange of ", bytes, " bytes");
  count(bytes, traffic);
  do_exchange_call_headers(send, recv, bytes, dev);
}

void Communicator::reduce_scatter(BufferRef send, BufferRef recv, int64_t count_, DType dtype,
                                  ReduceOp op, const Device& dev, Traffic& traffic) {
  QCOLL_CHECK(count_ >= 0, "reduce_scatter of ", count_, " elements");
  count(count_ * static_cast<int64_t>(dtype_size(dtype)), traffic);
  do_reduce_scatter(send, recv, count_, dtype, op, dev);
}

void Communicator::all_reduce(BufferRef buf, int64_t count_, DType dtype, ReduceOp op,
                              const Device& dev, Traffic& traffic) {
  QCOLL_CHECK(count_ >= 0, "all_reduce of ", count_, " elements");
  const int64_t shard = (count_ + size_ - 1) / size_;
  count(2 * shard * static_cast<int64_t>(dtype_size(dtype)), traffic);
  do_all_reduce(buf, count_, dtype, op, dev);
}

void Communicator::do_all_reduce(BufferRef, int64_t, DType, ReduceOp, const Device&) {
  QCOLL_CHECK(false, "this transport has no all-reduce of its own");
}

}  // namespace qcoll
