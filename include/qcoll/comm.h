// The one transport interface the collectives are written against. Two implementations:
// raw NCCL communicators (src/comm/nccl_comm.*) and any torch.distributed ProcessGroup,
// reached through Python callbacks (src/python/torch_comm.*).
//
// Members are numbered 0..size()-1 within the communicator. Every call is collective:
// all members call it with the same sizes. Byte counts handed to the transport are
// recorded in the Traffic passed with the call, split by whether the peer shares this
// rank's node (one accounting rule for every path: the bytes this rank must deliver to
// each other member, as if exchanged directly).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "qcoll/device.h"
#include "qcoll/dtype.h"

namespace qcoll {

enum class ReduceOp : int32_t { kSum = 0, kAvg = 1 };  // codes exported as _C.OPS

inline const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kAvg ? "avg" : "sum"; }

// A buffer passed to the transport. Transports that address memory by pointer (NCCL) use
// `ptr`; the torch transport addresses the caller's tensors by (buffer id, byte offset) in
// `table`, the call's own buffers object (python/qcoll/_runtime/buffers.py), which the
// caller passes with the call and the core hands back with every exchange (no per-group
// registry), since Python cannot make a tensor out of a raw pointer. Ids: BufferId.
struct BufferRef {
  void* ptr = nullptr;
  int32_t buffer = -1;
  int64_t offset = 0;
  const void* table = nullptr;  // opaque to the core; the caller's per-call buffers object

  BufferRef at(int64_t bytes) const {
    return BufferRef{static_cast<char*>(ptr) + bytes, buffer, offset + bytes, table};
  }
};

struct Traffic {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> intra_bytes{0};
  std::atomic<int64_t> inter_bytes{0};
  std::atomic<int64_t> header_bytes{0};  // the wire headers' share of intra + inter bytes

  void reset() {
    calls = 0;
    intra_bytes = 0;
    inter_bytes = 0;
    header_bytes = 0;
  }
  void add(const Traffic& t) {
    calls += t.calls.load();
    intra_bytes += t.intra_bytes.load();
    inter_bytes += t.inter_bytes.load();
    header_bytes += t.header_bytes.load();
  }
};

class Communicator {
 public:
  // member_is_local[p]: member p runs on this rank's node (true for this rank itself).
  Communicator(int rank, int size, std::vector<bool> member_is_local);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool is_local(int member) const { return member_is_local_[member]; }
  int local_peers() const { return local_peers_; }  // other members on this node
  // True when GPU exchanges are enqueued on the stream of the Device passed with each call
  // (NCCL); false when the transport orders itself after the framework's current stream.
  virtual bool uses_call_stream() const { return false; }

  // Block p (bytes_per_peer bytes) of send goes to member p; block q of recv comes from q.
  void all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer, const Device& dev,
                  Traffic& traffic);
  // recv holds size() blocks of `bytes`, block q from member q.
  void all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device& dev,
                  Traffic& traffic);
  // The call check's all-gather of call headers (wire_header.h's check_call), counted as
  // an all-gather. A transport may run it on a channel of its own, apart from the
  // payloads: a rank checking a signature its peers agreed on before (they skip the check)
  // then waits for them until the timeout, instead of its header being taken for their
  // payload (silent garbage) or their payload overrunning its header buffer (gloo aborts).
  void exchange_call_headers(BufferRef send, BufferRef recv, int64_t bytes, const Device& dev,
                             Traffic& traffic);
  // The transport's own reduce-scatter: send holds size() * count elements, recv count.
  void reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype, ReduceOp op,
                      const Device& dev, Traffic& traffic);
  // The transport's own all-reduce of count elements, in place. Counted as the
  // reduce-scatter and all-gather it amounts to (ceil(count / size) elements per peer each).
  void all_reduce(BufferRef buf, int64_t count, DType dtype, ReduceOp op, const Device& dev,
                  Traffic& traffic);
  virtual bool has_all_reduce() const { return false; }
  // Adds one exchange of bytes_per_peer to every other member to `traffic` (the rule).
  void count(int64_t bytes_per_peer, Traffic& traffic) const;

  // Call signatures every member has been seen to agree on (wire_header.h's check_call):
  // the check exchanges a signature once per communicator, not once per call.
  bool agreed(const std::string& signature) const;
  void add_agreed(const std::string& signature);

 protected:
  virtual void do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                             const Device& dev) = 0;
  virtual void do_all_gather(BufferRef send, BufferRef recv, int64_t bytes,
                             const Device& dev) = 0;
  virtual void do_exchange_call_headers(BufferRef send, BufferRef recv, int64_t bytes,
                                        const Device& dev) {
    do_all_gather(send, recv, bytes, dev);
  }
  virtual void do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype,
                                 ReduceOp op, const Device& dev) = 0;
  virtual void do_all_reduce(BufferRef buf, int64_t count, DType dtype, ReduceOp op,
                             const Device& dev);

 private:
  int rank_;
  int size_;
  std::vector<bool> member_is_local_;
  int local_peers_ = 0;
  mutable std::mutex agreed_mutex_;
  std::set<std::string> agreed_;
};

}  // namespace qcoll
