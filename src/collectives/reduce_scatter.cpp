// qgZ reduce-scatter: per pipeline stage, one slice of every partition goes through
// encode -> all-to-all -> [fused dequantize-reduce-quantize -> all-to-all] -> dequantize-
// reduce into the output. Stages are independent, so the lanes (lanes.h) overlap stage s's
// inter-node hop with stage s+1's intra-node hop. Every slot carries a header
// (wire_header.h) when the plan asks for one; received headers are checked before decoding.
#include <memory>

#include "qcoll/collectives.h"
#include "qcoll/error.h"
#include "qcoll/lanes.h"
#include "qcoll/wire.h"
#include "qcoll/wire_header.h"

namespace qcoll {

namespace {

uint8_t* bytes(const BufferRef& r) { return static_cast<uint8_t*>(r.ptr); }

char* element(void* base, int64_t index, DType dtype) {
  return static_cast<char*>(base) + index * static_cast<int64_t>(dtype_size(dtype));
}

// What every stage of one call shares.
struct Call {
  const ReduceScatterPlan& p;
  const CollectiveBuffers& b;
  DType dtype;
  ReduceOp op;
  Traffic& traffic;
  uint32_t sequence;
};

// Stamp `count` slots of stage s, exchange `e`, and count the headers sent to peers.
void stamp(const Call& c, int32_t s, Exchange e, const WireFormat& fmt, uint8_t* slots,
           int64_t stride, int64_t count, int32_t sender, int64_t headers_to_peers) {
  if (!c.p.header) return;
  write_headers(slots, stride, count, make_header(e, fmt, c.p.slice_len(s), c.sequence, s, sender));
  c.traffic.header_bytes += c.p.header * headers_to_peers;
}

template <typename SenderOf>
void verify(const Call& c, int32_t s, Exchange e, const WireFormat& fmt, const uint8_t* slots,
            int64_t stride, int64_t count, SenderOf sender_of, int32_t self) {
  if (!c.p.header) return;
  check_headers(slots, stride, count, make_header(e, fmt, c.p.slice_len(s), c.sequence, s, 0),
                sender_of, self);
}

// Encode slice s of every partition into the stage's first send slots.
void encode_stage(const Call& c, int32_t s, const Device& device) {
  const ReduceScatterPlan& p = c.p;
  EncodeArgs e;
  e.input = c.b.input.ptr;
  e.dtype = c.dtype;
  e.partition_elems = p.n;
  e.slice_begin = p.slice_begin(s);
  e.len = p.slice_len(s);
  e.count = p.world;
  e.node_size = p.two_hop ? p.node_size : 0;  // Algorithm 2: group chunks by local peer
  e.nodes = p.nodes;
  e.fmt = p.first;
  e.output = bytes(c.b.workspace.at(p.send1(s) + p.header));
  e.chunk_stride = p.first_chunk(s);
  e.device = device;
  encode_chunks(e);
}

// Sum `sources` chunks (slot stride source_stride) at `slots` into output slice s.
void reduce_into_output(const Call& c, int32_t s, const uint8_t* slots, const WireFormat& fmt,
                        int32_t sources, int64_t source_stride, const Device& device) {
  const ReduceScatterPlan& p = c.p;
  ReduceArgs r;
  r.input = slots + p.header;
  r.in_fmt = fmt;
  r.len = p.slice_len(s);
  r.sources = sources;
  r.source_stride = source_stride;
  r.outputs = 1;
  r.divisor = c.op == ReduceOp::kAvg ? static_cast<float>(p.world) : 1.0f;
  r.out_values = element(c.b.output.ptr, p.slice_begin(s), c.dtype);
  r.out_dtype = c.dtype;
  r.device = device;
  reduce_chunks(r);
}

void flat_stage(const Call& c, int32_t s, Communicator& world, const Device& device) {
  const ReduceScatterPlan& p = c.p;
  const int64_t slot = p.first_chunk(s);
  if (p.sends_input()) {  // partition k of the input is the slot for rank k
    world.all_to_all(c.b.input, c.b.workspace.at(p.recv1(s)), slot, device, c.traffic);
    reduce_into_output(c, s, bytes(c.b.workspace.at(p.recv1(s))), p.first, p.world, slot, device);
    return;
  }
  encode_stage(c, s, device);
  stamp(c, s, Exchange::kFlat, p.first, bytes(c.b.workspace.at(p.send1(s))), slot, p.world,
        world.rank(), p.world - 1);
  world.all_to_all(c.b.workspace.at(p.send1(s)), c.b.workspace.at(p.recv1(s)), slot, device,
                   c.traffic);
  const uint8_t* recv = bytes(c.b.workspace.at(p.recv1(s)));
  verify(c, s, Exchange::kFlat, p.first, recv, slot, p.world,
         [](int64_t k) { return static_cast<int32_t>(k); }, world.rank());
  reduce_into_output(c, s, recv, p.first, p.world, slot, device);
}

void intra_hop(const Call& c, int32_t s, Communicator& intra, Communicator& inter,
               const Device& device) {
  const ReduceScatterPlan& p = c.p;
  const int64_t c1 = p.first_chunk(s);
  encode_stage(c, s, device);
  stamp(c, s, Exchange::kIntraHop, p.first, bytes(c.b.workspace.at(p.send1(s))), c1, p.world,
        intra.rank(), int64_t{p.nodes} * (p.node_size - 1));
  // Local peer j receives the nodes chunks of partitions j, j + node_size, ...
  intra.all_to_all(c.b.workspace.at(p.send1(s)), c.b.workspace.at(p.recv1(s)), p.nodes * c1,
                   device, c.traffic);
  const uint8_t* recv = bytes(c.b.workspace.at(p.recv1(s)));
  const int32_t nodes = p.nodes;
  verify(c, s, Exchange::kIntraHop, p.first, recv, c1, p.world,
         [nodes](int64_t k) { return static_cast<int32_t>(k / nodes); }, intra.rank());
  // For each node: sum the node_size local contributions, re-encode at the inter format.
  uint8_t* send2 = bytes(c.b.workspace.at(p.send2(s)));
  ReduceArgs r;
  r.input = recv + p.header;
  r.in_fmt = p.first;
  r.len = p.slice_len(s);
  r.sources = p.node_size;
  r.source_stride = p.nodes * c1;
  r.outputs = p.nodes;
  r.output_in_stride = c1;
  r.out_wire = send2 + p.header;
  r.out_fmt = p.second;
  r.out_chunk_stride = p.second_chunk(s);
  if (c.b.inter_residual && p.second.quantized()) {  // stage s: columns of every row
    r.residual = c.b.inter_residual + p.slice_begin(s);
    r.residual_stride = p.n;
  }
  r.device = device;
  reduce_chunks(r);
  stamp(c, s, Exchange::kInterHop, p.second, send2, p.second_chunk(s), p.nodes, inter.rank(),
        p.nodes - 1);
}

void inter_hop(const Call& c, int32_t s, Communicator& inter, const Device& device) {
  const ReduceScatterPlan& p = c.p;
  const int64_t c2 = p.second_chunk(s);
  inter.all_to_all(c.b.workspace.at(p.send2(s)), c.b.workspace.at(p.recv2(s)), c2, device,
                   c.traffic);
  const uint8_t* recv = bytes(c.b.workspace.at(p.recv2(s)));
  verify(c, s, Exchange::kInterHop, p.second, recv, c2, p.nodes,
         [](int64_t k) { return static_cast<int32_t>(k); }, inter.rank());
  reduce_into_output(c, s, recv, p.second, p.nodes, c2, device);
}

// The one 2-hop driver loop, for every kind of lanes. A failed inter lane stops the intra
// lane; the lanes are joined before this returns or throws.
void two_hop(const Call& c, Communicator& intra, Communicator& inter, const Device& device) {
  const ReduceScatterPlan& p = c.p;
  std::unique_ptr<Lanes> lanes =
      make_lanes(device, p.stages, intra.uses_call_stream() && inter.uses_call_stream());
  for (int32_t s = 0; s < p.stages && !lanes->failed(); ++s) {
    if (p.slice_len(s) == 0) continue;
    intra_hop(c, s, intra, inter, lanes->intra());
    Lanes& l = *lanes;
    lanes->then_inter([&c, s, &inter, &l] { inter_hop(c, s, inter, l.inter()); });
  }
  lanes->join();
}

}  // namespace

void reduce_scatter(const ReduceScatterPlan& p, const CollectiveBuffers& b, DType dtype,
                    ReduceOp op, Communicator& world, Communicator* intra, Communicator* inter,
                    const Device& device, Traffic& traffic, uint32_t sequence) {
  QCOLL_CHECK(world.size() == p.world, "plan for ", p.world, " ranks, communicator of ",
              world.size());
  traffic.calls += 1;
  if (p.call_check) {
    CallHeader call;
    const bool all_reduce = p.call_numel >= 0;  // checked as the all-reduce it is half of
    call.kind = static_cast<uint8_t>(all_reduce ? CallKind::kAllReduce : CallKind::kReduceScatter);
    call.dtype = static_cast<uint8_t>(dtype);
    call.first_format = static_cast<uint8_t>(p.first.format);
    call.second_format = static_cast<uint8_t>(p.two_hop ? p.second.format : CodeFormat::kRaw);
    call.op = static_cast<uint8_t>(op);
    call.two_hop = p.two_hop;
    call.stages = static_cast<uint8_t>(p.stages < 255 ? p.stages : 255);
    call.hadamard = hadamard_log2(p.first.hadamard_size | p.second.hadamard_size);
    call.group_size = p.encodes_input() || p.reencodes_partial_sums()
                          ? static_cast<uint32_t>(p.first.group_size) : 0;
    call.sequence = sequence;
    call.n = all_reduce ? p.call_numel : p.n;
    check_call(world, b.workspace, call, device, traffic);
  }
  if (p.transport_reduces()) {  // the baseline: the transport's reduce-scatter
    world.reduce_scatter(b.input, b.output, p.n, dtype, op, device, traffic);
    return;
  }
  if (p.n == 0) return;
  const Call call{p, b, dtype, op, traffic, sequence};
  if (!p.two_hop) {
    for (int32_t s = 0; s < p.stages; ++s)
      if (p.slice_len(s) > 0) flat_stage(call, s, world, device);
    return;
  }
  QCOLL_CHECK(intra && inter && intra->size() == p.node_size && inter->size() == p.nodes,
              "two-hop reduce-scatter needs intra-node (", p.node_size,
              " ranks) and inter-node (", p.nodes, " ranks) communicators");
  two_hop(call, *intra, *inter, device);
}

Traffic& allgather_traffic() {
  static Traffic t;
  return t;
}

Traffic& reduce_scatter_traffic() {
  static Traffic t;
  return t;
}

Traffic& all_reduce_traffic() {
  static Traffic t;
  return t;
}

}  // namespace qcoll
