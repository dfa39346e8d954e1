// The unquantized all-reduce: one exchange of the transport's own, after the call check.
// (Quantized all-reduces are a reduce-scatter then an all-gather: python/qcoll/all_reduce.py.)
#include "qcoll/collectives.h"
#include "qcoll/error.h"
#include "qcoll/wire_header.h"

namespace qcoll {

void all_reduce_raw(int64_t count, const CollectiveBuffers& b, DType dtype, DType wire, ReduceOp op,
                    Communicator& comm, const Device& device, Traffic& traffic,
                    uint32_t sequence, int64_t call_numel) {
  QCOLL_CHECK(comm.has_all_reduce(), "all_reduce_raw needs a transport with an all-reduce");
  traffic.calls += 1;
  if (call_numel >= 0) {
    CallHeader call;
    call.kind = static_cast<uint8_t>(CallKind::kAllReduce);
    call.dtype = static_cast<uint8_t>(dtype);
    call.first_format = static_cast<uint8_t>(CodeFormat::kRaw);
    call.second_format = static_cast<uint8_t>(wire);
    call.op = static_cast<uint8_t>(op);
    call.sequence = sequence;
    call.n = call_numel;
    check_call(comm, b.workspace, call, device, traffic);
  }
  if (count == 0) return;
  comm.all_reduce(b.output, count, wire, op, device, traffic);
}

}  // namespace qcoll
