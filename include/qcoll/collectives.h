// The collectives, written once against Communicator + the wire kernels. Callers
// (the Python layer) allocate the output and the workspace the plan asks for, and pass
// every buffer as a BufferRef so that any transport can address it.
#pragma once

#include "qcoll/comm.h"
#include "qcoll/plan.h"

namespace qcoll {

// The ids of a call's buffers in BufferRef::buffer (exported as _C.BUFFERS: the torch
// transport's per-call buffers object indexes its tensors by them).
enum class BufferId : int32_t { kInput = 0, kOutput = 1, kWorkspace = 2 };
inline constexpr int32_t kBufferCount = 3;

inline const char* buffer_name(BufferId id) {
  return id == BufferId::kInput ? "input" : id == BufferId::kOutput ? "output" : "workspace";
}

struct CollectiveBuffers {
  BufferRef input;
  BufferRef output;
  BufferRef workspace;  // plan.workspace_bytes() bytes
  // Reduce-scatter only, optional: the error-feedback residual (ReduceArgs::residual) of a
  // 2-hop call's inter-node re-encode, when that hop is quantized: fp32, nodes x n, row k
  // for the partial sum this rank re-encodes for node k (partition local rank + k *
  // node_size), in the inter-node chunks' domain. Read and replaced by the call; kernels
  // only (never a transport buffer). Ignored by other calls.
  float* inter_residual = nullptr;

  // The buffers at these pointers, ids BufferId, all indexed in `table` (see BufferRef).
  static CollectiveBuffers of(void* input, void* output, void* workspace, const void* table) {
    CollectiveBuffers b;
    b.input = BufferRef{input, static_cast<int32_t>(BufferId::kInput), 0, table};
    b.output = BufferRef{output, static_cast<int32_t>(BufferId::kOutput), 0, table};
    b.workspace = BufferRef{workspace, static_cast<int32_t>(BufferId::kWorkspace), 0, table};
    return b;
  }
};

// output = the n elements of every member, member order; every rank's output is identical
// (its own slice also goes through the codec).
// sequence: the group's call number, stamped into every wire header (plan.header > 0).
void all_gather(const AllGatherPlan& plan, const CollectiveBuffers& buffers, DType dtype,
                Communicator& comm, const Device& device, Traffic& traffic,
                uint32_t sequence = 0);

// output (n elements) = op over members of their input partition rank (input holds
// world * n elements). Flat plan: one all-to-all over `world`. Two-hop plan: intra-node
// all-to-all over `intra` with the slices reordered (Algorithm 2 of ZeRO++), fused
// dequantize-reduce-quantize, inter-node all-to-all over `inter`, dequantize-reduce.
// Raw flat plan (format kRaw, one hop): the transport's own reduce-scatter, or with the
// plan's raw_exchange one all-to-all of the raw inputs and their fp32 sum (rounded once).
void reduce_scatter(const ReduceScatterPlan& plan, const CollectiveBuffers& buffers, DType dtype,
                    ReduceOp op, Communicator& world, Communicator* intra, Communicator* inter,
                    const Device& device, Traffic& traffic, uint32_t sequence = 0);

// The unquantized all-reduce where the transport has one (comm.has_all_reduce()): the call
// check of a call of call_numel elements of dtype (workspace: (size + 1) call headers;
// call_numel < 0: none, a later part of a checked call), then the transport's all-reduce of
// buffers.output in place: count elements of wire (the caller's dtype, or fp32 values of a
// bf16/fp16 tensor).
void all_reduce_raw(int64_t count, const CollectiveBuffers& buffers, DType dtype, DType wire,
                    ReduceOp op, Communicator& comm, const Device& device, Traffic& traffic,
                    uint32_t sequence, int64_t call_numel);

// Process-wide byte counters read by qcoll.stats().
Traffic& allgather_traffic();
Traffic& reduce_scatter_traffic();
// qcoll.quantized_all_reduce: a reduce-scatter then an all-gather, composed in Python
// (python/qcoll/all_reduce.py) and counted once here.
Traffic& all_reduce_traffic();

}  // namespace qcoll
