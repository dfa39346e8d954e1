#include "qcoll/plan.h"

#include "qcoll/error.h"
#include "qcoll/wire_header.h"

namespace qcoll {

namespace {

WireFormat wire(CodeFormat format, int64_t group_size, DType dtype, int32_t hadamard_size = 0) {
  WireFormat f;
  f.format = format;
  f.group_size = group_size;
  f.raw_dtype = dtype;
  f.hadamard_size = format != CodeFormat::kRaw ? hadamard_size : 0;
  validate(f);
  return f;
}

}  // namespace

ReduceScatterPlan plan_reduce_scatter(int32_t world, int32_t node_size, int64_t n, DType dtype,
                                      CodeFormat intra, CodeFormat inter, int64_t group_size,
                                      int32_t stages, int32_t hierarchical, bool headers,
                                      int64_t min_stage_bytes, int32_t hadamard_size,
                                      bool raw_exchange, int64_t call_numel) {
  QCOLL_ARG_CHECK(world >= 1 && node_size >= 1 && world % node_size == 0, "node_size ",
                  node_size, " must divide the group size ", world);
  QCOLL_ARG_CHECK(n >= 0, "output numel must be >= 0, got ", n);
  QCOLL_ARG_CHECK(stages >= 1, "pipeline_stages must be >= 1, got ", stages);
  QCOLL_ARG_CHECK(dtype_valid(static_cast<int32_t>(dtype)), "reduce_scatter: dtype must be "
                  "float32, float16 or bfloat16 (code 0-2), got code ", static_cast<int>(dtype));
  ReduceScatterPlan p;
  p.world = world;
  p.node_size = node_size;
  p.nodes = world / node_size;
  const bool layered = p.nodes > 1 && node_size > 1;
  p.two_hop = layered && hierarchical != 0;
  p.requested_stages = stages;
  // Fewer stages where slices would be too small for the overlap to pay; at least one.
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(dtype));
  const int64_t useful = min_stage_bytes > 0 ? bytes / min_stage_bytes : stages;
  p.stages = static_cast<int32_t>(useful < 1 ? 1 : (useful < stages ? useful : stages));
  p.n = n;
  p.slice = (n + p.stages - 1) / p.stages;
  p.header = headers ? kHeaderBytes : 0;
  p.call_check = headers ? (world + 1) * kCallHeaderBytes : 0;
  p.call_numel = call_numel;
  if (p.two_hop) {
    p.first = wire(intra, group_size, dtype, hadamard_size);
    // An unquantized inter-node hop carries the fp32 partial sums: bf16/fp16 inputs are
    // rounded once, at the end, not again between the hops (issue 26 item 5).
    p.second = wire(inter, group_size, inter == CodeFormat::kRaw ? DType::kFloat32 : dtype,
                    hadamard_size);
  } else {
    // One hop: it crosses nodes whenever the group spans several.
    p.first = wire(p.nodes > 1 ? inter : intra, group_size, dtype, hadamard_size);
    p.second = p.first;
  }
  p.raw_exchange = raw_exchange;
  if (p.sends_input()) {  // nothing to encode, so nothing for stages to overlap
    p.stages = 1;
    p.slice = n;
    p.header = 0;  // the call check covers the call; raw all-gather slots carry none either
  }
  return p;
}

AllGatherPlan plan_all_gather(int32_t world, int64_t n, DType dtype, CodeFormat format,
                              int64_t group_size, bool headers) {
  QCOLL_ARG_CHECK(n >= 0, "input numel must be >= 0, got ", n);
  AllGatherPlan p;
  p.world = world;
  p.n = n;
  p.fmt = wire(format, group_size, dtype);
  p.header = headers && p.fmt.quantized() ? kHeaderBytes : 0;
  p.call_check = headers ? (world + 1) * kCallHeaderBytes : 0;
  return p;
}

}  // namespace qcoll
