// The Communicator backed by a torch.distributed ProcessGroup: each exchange calls back
// into a Python transport object (python/qcoll/_torch_transport.py), handing it the call's
// own buffers object (BufferRef::table) and (buffer id, byte offset) pairs into it. The
// collective runs with the GIL released; each callback takes it.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>
#include <vector>

#include "qcoll/comm.h"
#include "qcoll/error.h"

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
    transport_.attr("all_to_all")(table(send, recv), send.buffer, send.offset, recv.buffer,
                                  recv.offset, bytes_per_peer);
  }

  void do_all_gather(BufferRef send, BufferRef recv, int64_t bytes, const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("all_gather")(table(send, recv), send.buffer, send.offset, recv.buffer,
                                  recv.offset, bytes);
  }

  void do_exchange_call_headers(BufferRef send, BufferRef recv, int64_t bytes,
                                const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("exchange_call_headers")(table(send, recv), send.buffer, send.offset,
                                             recv.buffer, recv.offset, bytes);
  }

  void do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count, DType dtype, ReduceOp op,
                         const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("reduce_scatter")(table(send, recv), send.buffer, send.offset, recv.buffer,
                                      recv.offset, count, static_cast<int>(dtype),
                                      static_cast<int>(op));
  }

  bool has_all_reduce() const override { return true; }

  void do_all_reduce(BufferRef buf, int64_t count, DType dtype, ReduceOp op,
                     const Device&) override {
    pybind11::gil_scoped_acquire gil;
    transport_.attr("all_reduce")(table(buf, buf), buf.buffer, buf.offset, count,
                                  static_cast<int>(dtype), static_cast<int>(op));
  }

 private:
  // The call's buffers object both refs index (the caller holds it for the call).
  static pybind11::handle table(const BufferRef& a, const BufferRef& b) {
    QCOLL_CHECK(a.table != nullptr && a.table == b.table,
                "a torch transport exchange needs both buffers in the call's buffers object");
    return pybind11::handle(static_cast<PyObject*>(const_cast<void*>(a.table)));
  }

  pybind11::object transport_;
};

}  // namespace qcoll
