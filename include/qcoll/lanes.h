// Lanes of the pipelined reduce-scatter: intra-node hops on one, inter-node hops on the
// other, so stage s's inter-node exchange overlaps stage s+1's intra-node exchange.
//
// Lanes is the one interface the 2-hop driver loop is written against (reduce_scatter.cpp);
// make_lanes picks CPU threads, CUDA streams, or the serial case. Every implementation
// joins its lanes before it is destroyed, on every path, exceptions included, so no hop
// can still be using the workspace once the call has returned or thrown.
#pragma once

#include <functional>
#include <memory>

#include "qcoll/device.h"

namespace qcoll {

class Lanes {
 public:
  virtual ~Lanes() = default;
  virtual Device intra() const = 0;
  virtual Device inter() const = 0;
  // Runs `work` on the inter lane, after everything the intra lane has done so far.
  virtual void then_inter(std::function<void()> work) = 0;
  // Waits for both lanes; rethrows the inter lane's first error.
  virtual void join() = 0;
  // True once the inter lane has failed: the driver stops issuing work.
  virtual bool failed() const = 0;
};

// stages == 1: serial. CPU: intra work in the calling thread, inter work in a second one
// (each lane blocks in its own communicator). CUDA with communicators that enqueue on the
// call's stream (streams == true): two qcoll-owned streams (StreamLanes); otherwise serial.
std::unique_ptr<Lanes> make_lanes(const Device& caller, int stages, bool streams);

// Two ordered GPU lanes (src/cuda/stream_lanes.cu): the caller's stream and its
// Device::lane_stream when it gives one (qcoll's Python layer: the group's two streams),
// else two qcoll-owned streams of the device. Both lanes start after the work already on
// the caller's stream; the caller's stream waits for both when the lanes are joined. Only
// events and stream waits join them, so a CUDA-graph capture of the caller's stream
// captures both lanes.
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

// For a CUDA device (see StreamLanes). Throws without CUDA.
std::unique_ptr<StreamLanes> make_stream_lanes(const Device& caller);

}  // namespace qcoll
