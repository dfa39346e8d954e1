// Two ordered lanes of GPU work for the pipelined reduce-scatter: intra-node hops on one
// stream, inter-node hops on another, so stage s's inter-node exchange overlaps stage
// s+1's intra-node exchange. Both lanes start after the work already on the caller's
// stream, and the caller's stream waits for both when the lanes are closed.
#pragma once

#include <memory>

#include "qcoll/device.h"

namespace qcoll {

class StreamLanes {
 public:
  virtual ~StreamLanes() = default;
  virtual Device intra() const = 0;
  virtual Device inter() const = 0;
  // Everything enqueued on the intra lane so far happens before what the inter lane gets next.
  virtual void inter_waits_for_intra() = 0;
  // The caller's stream waits for both lanes (call once, at the end).
  virtual void join() = 0;
};

// For a CUDA device: lanes on two qcoll-owned streams of that device. Throws without CUDA.
std::unique_ptr<StreamLanes> make_stream_lanes(const Device& caller);

}  // namespace qcoll
