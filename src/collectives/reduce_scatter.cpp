// qgZ reduce-scatter: per pipeline stage, one slice of every partition goes through
// encode -> all-to-all -> [fused dequantize-reduce-quantize -> all-to-all] -> dequantize-
// reduce into the output. Stages are independent, so a transport may overlap stage s's
// inter-node hop with stage s+1's intra-node hop.
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "qcoll/collectives.h"
#include "qcoll/lanes.h"
#include "qcoll/error.h"
#include "qcoll/wire.h"

namespace qcoll {

namespace {

uint8_t* bytes(const BufferRef& r) { return static_cast<uint8_t*>(r.ptr); }

char* element(void* base, int64_t index, DType dtype) {
  return static_cast<char*>(base) + index * static_cast<int64_t>(dtype_size(dtype));
}

// Encode slice s of every partition into the stage's first send buffer.
void encode_stage(const ReduceScatterPlan& p, int32_t s, const CollectiveBuffers& b, DType dtype,
                  const Device& device) {
  EncodeArgs e;
  e.input = b.input.ptr;
  e.dtype = dtype;
  e.partition_elems = p.n;
  e.slice_begin = p.slice_begin(s);
  e.len = p.slice_len(s);
  e.count = p.world;
  e.node_size = p.two_hop ? p.node_size : 0;  // Algorithm 2: group chunks by local peer
  e.nodes = p.nodes;
  e.fmt = p.first;
  e.output = bytes(b.workspace.at(p.send1(s)));
  e.chunk_stride = p.first_chunk(s);
  e.device = device;
  encode_chunks(e);
}

// Sum `sources` chunks (stride source_stride) at `in` into output slice s.
void reduce_into_output(const ReduceScatterPlan& p, int32_t s, const uint8_t* in,
                        const WireFormat& fmt, int32_t sources, int64_t source_stride,
                        const CollectiveBuffers& b, DType dtype, ReduceOp op,
                        const Device& device) {
  ReduceArgs r;
  r.input = in;
  r.in_fmt = fmt;
  r.len = p.slice_len(s);
  r.sources = sources;
  r.source_stride = source_stride;
  r.outputs = 1;
  r.divisor = op == ReduceOp::kAvg ? static_cast<float>(p.world) : 1.0f;
  r.out_values = element(b.output.ptr, p.slice_begin(s), dtype);
  r.out_dtype = dtype;
  r.device = device;
  reduce_chunks(r);
}

void flat_stage(const ReduceScatterPlan& p, int32_t s, const CollectiveBuffers& b, DType dtype,
                ReduceOp op, Communicator& world, const Device& device, Traffic& traffic) {
  const int64_t chunk = p.first_chunk(s);
  encode_stage(p, s, b, dtype, device);
  world.all_to_all(b.workspace.at(p.send1(s)), b.workspace.at(p.recv1(s)), chunk, device,
                   traffic);
  reduce_into_output(p, s, bytes(b.workspace.at(p.recv1(s))), p.first, p.world, chunk, b, dtype,
                     op, device);
}

void intra_hop(const ReduceScatterPlan& p, int32_t s, const CollectiveBuffers& b, DType dtype,
               Communicator& intra, const Device& device, Traffic& traffic) {
  const int64_t c1 = p.first_chunk(s);
  encode_stage(p, s, b, dtype, device);
  // Local peer j receives the nodes chunks of partitions j, j + node_size, ...
  intra.all_to_all(b.workspace.at(p.send1(s)), b.workspace.at(p.recv1(s)), p.nodes * c1, device,
                   traffic);
  // For each node: sum the node_size local contributions, re-encode at the inter format.
  ReduceArgs r;
  r.input = bytes(b.workspace.at(p.recv1(s)));
  r.in_fmt = p.first;
  r.len = p.slice_len(s);
  r.sources = p.node_size;
  r.source_stride = p.nodes * c1;
  r.outputs = p.nodes;
  r.output_in_stride = c1;
  r.out_wire = bytes(b.workspace.at(p.send2(s)));
  r.out_fmt = p.second;
  r.out_chunk_stride = p.second_chunk(s);
  r.device = device;
  reduce_chunks(r);
}

void inter_hop(const ReduceScatterPlan& p, int32_t s, const CollectiveBuffers& b, DType dtype,
               ReduceOp op, Communicator& inter, const Device& device, Traffic& traffic) {
  const int64_t c2 = p.second_chunk(s);
  inter.all_to_all(b.workspace.at(p.send2(s)), b.workspace.at(p.recv2(s)), c2, device, traffic);
  reduce_into_output(p, s, bytes(b.workspace.at(p.recv2(s))), p.second, p.nodes, c2, b, dtype,
                     op, device);
}

// CPU: intra hops in this thread, inter hops in a second one, so stage s's inter-node
// exchange overlaps stage s+1's intra-node exchange; each lane blocks in its own
// communicator.
void two_hop_overlapped(const ReduceScatterPlan& p, const CollectiveBuffers& b, DType dtype,
                        ReduceOp op, Communicator& intra, Communicator& inter,
                        const Device& device, Traffic& traffic) {
  std::mutex mutex;
  std::condition_variable changed;
  int32_t intra_done = 0;
  bool failed = false;
  std::exception_ptr inter_error;

  std::thread inter_lane([&] {
    try {
      for (int32_t s = 0; s < p.stages; ++s) {
        std::unique_lock<std::mutex> lock(mutex);
        changed.wait(lock, [&] { return intra_done > s || failed; });
        if (failed) return;
        lock.unlock();
        if (p.slice_len(s) > 0) inter_hop(p, s, b, dtype, op, inter, device, traffic);
      }
    } catch (...) {
      inter_error = std::current_exception();
    }
  });

  std::exception_ptr intra_error;
  try {
    for (int32_t s = 0; s < p.stages; ++s) {
      if (p.slice_len(s) > 0) intra_hop(p, s, b, dtype, intra, device, traffic);
      std::lock_guard<std::mutex> lock(mutex);
      intra_done = s + 1;
      changed.notify_one();
    }
  } catch (...) {
    intra_error = std::current_exception();
    std::lock_guard<std::mutex> lock(mutex);
    failed = true;
    changed.notify_one();
  }
  inter_lane.join();
  if (intra_error) std::rethrow_exception(intra_error);
  if (inter_error) std::rethrow_exception(inter_error);
}

// GPU: intra hops on one stream, inter hops on another, enqueued from this one thread in
// the same order on every rank (so communicators cannot deadlock on each other).
void two_hop_on_streams(const ReduceScatterPlan& p, const CollectiveBuffers& b, DType dtype,
                        ReduceOp op, Communicator& intra, Communicator& inter,
                        const Device& device, Traffic& traffic) {
  std::unique_ptr<StreamLanes> lanes = make_stream_lanes(device);
  for (int32_t s = 0; s < p.stages; ++s) {
    if (p.slice_len(s) == 0) continue;
    intra_hop(p, s, b, dtype, intra, lanes->intra(), traffic);
    lanes->inter_waits_for_intra();
    inter_hop(p, s, b, dtype, op, inter, lanes->inter(), traffic);
  }
  lanes->join();
}

}  // namespace

void reduce_scatter(const ReduceScatterPlan& p, const CollectiveBuffers& b, DType dtype,
                    ReduceOp op, Communicator& world, Communicator* intra, Communicator* inter,
                    const Device& device, Traffic& traffic) {
  QCOLL_CHECK(world.size() == p.world, "plan for ", p.world, " ranks, communicator of ",
              world.size());
  traffic.calls += 1;
  if (!p.two_hop && !p.first.quantized()) {  // the baseline: the transport's reduce-scatter
    world.reduce_scatter(b.input, b.output, p.n, dtype, op, device, traffic);
    return;
  }
  if (p.n == 0) return;
  if (!p.two_hop) {
    for (int32_t s = 0; s < p.stages; ++s)
      if (p.slice_len(s) > 0) flat_stage(p, s, b, dtype, op, world, device, traffic);
    return;
  }
  QCOLL_CHECK(intra && inter && intra->size() == p.node_size && inter->size() == p.nodes,
              "two-hop reduce-scatter needs intra-node (", p.node_size,
              " ranks) and inter-node (", p.nodes, " ranks) communicators");
  if (p.stages > 1 && device.kind == DeviceKind::kCPU)
    return two_hop_overlapped(p, b, dtype, op, *intra, *inter, device, traffic);
  if (p.stages > 1 && device.kind == DeviceKind::kCUDA && intra->uses_call_stream() &&
      inter->uses_call_stream())
    return two_hop_on_streams(p, b, dtype, op, *intra, *inter, device, traffic);
  for (int32_t s = 0; s < p.stages; ++s) {
    if (p.slice_len(s) == 0) continue;
    intra_hop(p, s, b, dtype, *intra, device, traffic);
    inter_hop(p, s, b, dtype, op, *inter, device, traffic);
  }
}

Traffic& allgather_traffic() {
  static Traffic t;
  return t;
}

Traffic& reduce_scatter_traffic() {
  static Traffic t;
  return t;
}

}  // namespace qcoll
