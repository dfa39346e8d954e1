// The Communicator backed by a torch.distributed ProcessGroup: each exchange calls back
// into a Python transport object (python/qcoll/_torch_transport.py), which addresses the
// caller's tensors by (buffer id, byte offset). The collective runs with the GIL
// released; each callback takes it.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>
#include <vector>

#include "qcoll/comm.h"

namespace qcoll {

class TorchCommunicator : public Communicator {
 public:
  TorchCommunicator(int rank, int size, std::vector<bool> member_is_local,
                    pybind11::object transport)
      : Communicator(rank, size, std::move(member_is_local)), transport_(std::move(transport)) {}

  ~TorchCommunicator() override {
    pybind11::gil_scoped_acquire gil;
    transport_ = pybind11::object();
  }

 protected:
  void do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                     const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("all_to_all")(send.buffer, send.offset, recv.buffer, recv.offset,
                                  bytes_per_peer);
  }

  void do_all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("all_gather")(send.buffer, send.offset, recv.buffer, recv.offset, bytes);
  }

  void do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype, ReduceOp op,
                         const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("reduce_scatter")(send.buffer, send.offset, recv.buffer, recv.offset, count,
                                      static_cast<int>(dtype), static_cast<int>(op));
  }

  bool has_all_reduce() const override { return true; }

  void do_all_reduce(BufferRef buf, int64_t count, DType dtype, ReduceOp op,
                     const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("all_reduce")(buf.buffer, buf.offset, count, static_cast<int>(dtype),
                                  static_cast<int>(op));
  }

 private:
  pybind11::object transport_;
};

}  // namespace qcoll
