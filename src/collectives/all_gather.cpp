// qwZ all-gather: encode this rank's tensor once, all-gather the slots, check every
// header, decode every chunk (this rank's included, so all ranks hold bit-identical results).
#include "qcoll/collectives.h"
#include "qcoll/error.h"
#include "qcoll/wire.h"
#include "qcoll/wire_header.h"

namespace qcoll {

void all_gather(const AllGatherPlan& plan, const CollectiveBuffers& b, DType dtype,
                Communicator& comm, const Device& device, Traffic& traffic, uint32_t sequence) {
  QCOLL_CHECK(comm.size() == plan.world, "plan for ", plan.world, " ranks, communicator of ",
              comm.size());
  traffic.calls += 1;
  if (plan.call_check) {
    CallHeader call;
    call.kind = static_cast<uint8_t>(CallKind::kAllGather);
    call.dtype = static_cast<uint8_t>(dtype);
    call.first_format = static_cast<uint8_t>(plan.fmt.format);
    call.group_size = plan.fmt.quantized() ? static_cast<uint32_t>(plan.fmt.group_size) : 0;
    call.sequence = sequence;
    call.n = plan.n;
    check_call(comm, b.workspace, call, device, traffic);
  }
  if (!plan.fmt.quantized()) {  // the baseline: the transport's own all-gather
    comm.all_gather(b.input, b.output, plan.n * static_cast<int64_t>(dtype_size(dtype)), device,
                    traffic);
    return;
  }
  if (plan.n == 0) return;
  const int64_t slot = plan.chunk();
  const int64_t h = plan.header;
  const BufferRef recv = b.workspace.at(plan.recv());
  const BufferRef send = b.workspace.at(plan.send());

  EncodeArgs enc;
  enc.input = b.input.ptr;
  enc.dtype = dtype;
  enc.partition_elems = plan.n;
  enc.len = plan.n;
  enc.count = 1;
  enc.fmt = plan.fmt;
  enc.output = static_cast<uint8_t*>(send.ptr) + h;
  enc.chunk_stride = slot;
  enc.device = device;
  encode_chunks(enc);

  const ChunkHeader tag = make_header(Exchange::kAllGather, plan.fmt, plan.n, sequence, 0,
                                      comm.rank());
  if (h) {
    write_headers(static_cast<uint8_t*>(send.ptr), slot, 1, tag);
    traffic.header_bytes += h * (comm.size() - 1);
  }
  comm.all_gather(send, recv, slot, device, traffic);
  if (h)
    check_headers(static_cast<const uint8_t*>(recv.ptr), slot, plan.world, tag,
                  [](int64_t k) { return static_cast<int32_t>(k); }, comm.rank());

  ReduceArgs dec;
  dec.input = static_cast<const uint8_t*>(recv.ptr) + h;
  dec.in_fmt = plan.fmt;
  dec.len = plan.n;
  dec.sources = 1;
  dec.source_stride = slot;
  dec.outputs = plan.world;
  dec.output_in_stride = slot;
  dec.out_values = b.output.ptr;
  dec.out_dtype = dtype;
  dec.out_values_stride = plan.n;
  dec.device = device;
  reduce_chunks(dec);
}

}  // namespace qcoll
