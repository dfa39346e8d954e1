// The data layout of the quantized reduce-scatter: stages, slices, wire slots and the
// workspace they live in. Pure arithmetic, shared by every transport and device.
//
// A wire slot is [header | chunk]: header_bytes (0 or kHeaderBytes, see wire_header.h)
// then the chunk of wire.h. Slots are what the transport moves; kernels see the chunks.
#pragma once

#include <cstdint>

#include "qcoll/wire.h"

namespace qcoll {

// Pipelining pays only when each stage's slice is large enough for the overlap to beat the
// extra exchanges. Measured (bench/suites/collectives.py "pipeline" rows, 2 nodes x 2, fp32;
// bench/results/pipeline-cpu.json on a quiet machine, pipeline-cluster-cpu.json at 1 / 10
// Gbit/s): on loopback, slices of 8 MB ran 0.95x the one-stage time, 4 MB 0.84x, 2 MB
// 0.84-0.89x, 1 MB and less 0.54-0.80x; at 1 Gbit/s 4-8 MB slices ran 1.02-1.07x. A requested
// stage count that would cut one partition's slice below this many input bytes is reduced
// (to one stage at least), so no setting costs more than ~5-10% over one stage.
inline constexpr int64_t kMinPipelineStageBytes = int64_t{8} << 20;

struct ReduceScatterPlan {
  int32_t world = 1;
  int32_t node_size = 1;
  int32_t nodes = 1;
  bool two_hop = false;  // intra-node hop, then inter-node hop
  int32_t requested_stages = 1;
  int32_t stages = 1;    // requested_stages, reduced to what pays (kMinPipelineStageBytes)
  int64_t n = 0;      // output elements per rank (one partition)
  int64_t slice = 0;  // elements per stage slice (the last may be shorter or empty)
  int64_t header = 0;      // header bytes at the start of every slot
  int64_t call_check = 0;  // workspace bytes of the call check (wire_header.h), first
  // The reduce-scatter half of an all-reduce of call_numel elements: the call check compares
  // those (numel that pad to the same n differ there), as an all-reduce; -1: a reduce-scatter.
  int64_t call_numel = -1;
  WireFormat first;   // the only hop (flat), or the intra-node hop
  // The inter-node hop; with one hop, the same as first: either way the format the call
  // crosses nodes with when the group spans several (the all-reduce gathers in it).
  WireFormat second;

  // The encodes a rank makes of values only it holds (what error feedback compensates):
  // its input, by the first hop; its partial sums over its node, re-encoded for the
  // inter-node hop (nodes rows of n elements).
  bool encodes_input() const { return first.quantized(); }
  bool reencodes_partial_sums() const { return two_hop && second.quantized(); }
  // Flat and unquantized: the transport's own reduce-scatter (the baseline; its bf16/fp16
  // sums round at every step), unless the plan was asked for the raw exchange: the raw
  // values to their owner (all-to-all), summed there in fp32 and rounded once.
  bool raw_exchange = false;
  bool flat_raw() const { return !two_hop && !first.quantized(); }
  bool transport_reduces() const { return flat_raw() && !raw_exchange; }
  // The raw exchange sends the input as it lies when its partitions are whole wire slots:
  // one stage, no slot headers, no send slots (else they are copied into slots).
  bool sends_input() const {
    return flat_raw() && raw_exchange &&
           first.chunk_bytes(n) == n * static_cast<int64_t>(dtype_size(first.raw_dtype));
  }

  int64_t slice_begin(int32_t s) const { return s * slice; }
  int64_t slice_len(int32_t s) const {
    const int64_t rest = n - slice_begin(s);
    return rest <= 0 ? 0 : (rest < slice ? rest : slice);
  }
  // Slot bytes of stage s (the wire carries exactly these, the last stage's may be shorter).
  int64_t first_chunk(int32_t s) const {
    if (sends_input()) return slice_len(s) * static_cast<int64_t>(dtype_size(first.raw_dtype));  // a partition
    return header + first.chunk_bytes(slice_len(s));
  }
  int64_t second_chunk(int32_t s) const {
    return two_hop ? header + second.chunk_bytes(slice_len(s)) : 0;
  }

  // Workspace: per stage, [send1 | recv1 | send2 | recv2] sized for a full slice (no send1
  // when the hop sends the input).
  int64_t send1_bytes() const { return sends_input() ? 0 : world * (header + first.chunk_bytes(slice)); }
  int64_t stage_bytes() const {
    return send1_bytes() + world * (header + first.chunk_bytes(slice)) +
           (two_hop ? 2 * nodes * (header + second.chunk_bytes(slice)) : 0);
  }
  int64_t workspace_bytes() const { return call_check + stages * stage_bytes(); }
  int64_t send1(int32_t s) const { return call_check + s * stage_bytes(); }
  int64_t recv1(int32_t s) const { return send1(s) + send1_bytes(); }
  int64_t send2(int32_t s) const { return recv1(s) + world * (header + first.chunk_bytes(slice)); }
  int64_t recv2(int32_t s) const { return send2(s) + nodes * (header + second.chunk_bytes(slice)); }
};

// intra / inter: a code format quantizes that hop, kRaw sends raw values of `dtype`. hierarchical: 0 forces
// the flat 1-hop path over the whole group; 1 or -1 (the default) take the 2-hop path
// whenever the group has several nodes of several ranks (otherwise there is one hop).
// headers: the call is checked across ranks first and every slot starts with a ChunkHeader
// (host buffers only). raw_exchange: a flat unquantized plan exchanges the raw inputs and sums
// them in fp32 (rounding once) instead of handing the call to the transport. min_stage_bytes: the
// smallest slice (input bytes of one partition) a pipeline stage may have. hadamard_size:
// the quantized hops carry Hadamard-smoothed codes (0: off); raw hops carry plain values.
// Partial sums stay in the transformed domain between the hops (sums commute with it);
// the last decode inverts it.
ReduceScatterPlan plan_reduce_scatter(int32_t world, int32_t node_size, int64_t n, DType dtype,
                                      CodeFormat intra, CodeFormat inter, int64_t group_size,
                                      int32_t stages, int32_t hierarchical, bool headers = false,
                                      int64_t min_stage_bytes = kMinPipelineStageBytes,
                                      int32_t hadamard_size = 0, bool raw_exchange = false,
                                      int64_t call_numel = -1);

// All-gather of n elements per rank: one slot per rank.
struct AllGatherPlan {
  int32_t world = 1;
  int64_t n = 0;
  int64_t header = 0;
  int64_t call_check = 0;  // workspace bytes of the call check (wire_header.h), first
  WireFormat fmt;  // kRaw: the transport's own all-gather of raw values, no slots
  int64_t chunk() const { return header + fmt.chunk_bytes(n); }
  int64_t workspace_bytes() const {
    return call_check + (fmt.quantized() ? (world + 1) * chunk() : 0);
  }
  int64_t recv() const { return call_check; }  // world slots, then the send slot
  int64_t send() const { return call_check + world * chunk(); }
};

AllGatherPlan plan_all_gather(int32_t world, int64_t n, DType dtype, CodeFormat format,
                              int64_t group_size, bool headers = false);

}  // namespace qcoll
