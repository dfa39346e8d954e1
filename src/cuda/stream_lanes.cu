// StreamLanes on qcoll-owned CUDA streams, joined to the caller's stream with events.
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

#include "cuda/device_guard.h"
#include "qcoll/lanes.h"

namespace qcoll {
namespace {

struct LaneStreams {
  cudaStream_t intra = nullptr;
  cudaStream_t inter = nullptr;
};

// Two streams per device, created once and kept for the process lifetime (callers that
// give no lane stream of their own).
LaneStreams streams_for(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, LaneStreams> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it != streams.end()) return it->second;
  cuda::DeviceGuard guard(device);
  LaneStreams s;
  QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&s.intra, cudaStreamNonBlocking));
  QCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&s.inter, cudaStreamNonBlocking));
  streams.emplace(device, s);
  return s;
}

// The caller's lane stream when it gives one: intra-node hops then stay on the caller's own
// stream (it waits for nothing), inter-node hops go to the lane stream.
LaneStreams lanes_for(const Device& caller) {
  if (caller.lane_stream == nullptr) return streams_for(caller.index);
  LaneStreams s;
  s.intra = static_cast<cudaStream_t>(caller.stream);
  s.inter = static_cast<cudaStream_t>(caller.lane_stream);
  return s;
}

class CudaStreamLanes final : public StreamLanes {
 public:
  explicit CudaStreamLanes(const Device& caller)
      : caller_(caller), guard_(caller.index), streams_(lanes_for(caller)) {
    QCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    // Both lanes start after the caller's pending work (the input is produced there). Only
    // events and stream waits: legal while the caller's stream is captured into a CUDA
    // graph (the lanes are forked from and joined back into it).
    QCOLL_CUDA_CHECK(cudaEventRecord(event_, caller_stream()));
    QCOLL_CUDA_CHECK(cudaStreamWaitEvent(streams_.intra, event_, 0));
    QCOLL_CUDA_CHECK(cudaStreamWaitEvent(streams_.inter, event_, 0));
  }

  ~CudaStreamLanes() override { cudaEventDestroy(event_); }

  Device intra() const override { return on(streams_.intra); }
  Device inter() const override { return on(streams_.inter); }

  void inter_waits_for_intra() override {
    // Recording again is safe: cudaStreamWaitEvent captures the event's state at call time.
    QCOLL_CUDA_CHECK(cudaEventRecord(event_, streams_.intra));
    QCOLL_CUDA_CHECK(cudaStreamWaitEvent(streams_.inter, event_, 0));
  }

  void join() override {
    QCOLL_CUDA_CHECK(cudaEventRecord(event_, streams_.intra));
    QCOLL_CUDA_CHECK(cudaStreamWaitEvent(caller_stream(), event_, 0));
    QCOLL_CUDA_CHECK(cudaEventRecord(event_, streams_.inter));
    QCOLL_CUDA_CHECK(cudaStreamWaitEvent(caller_stream(), event_, 0));
  }

 private:
  cudaStream_t caller_stream() const { return static_cast<cudaStream_t>(caller_.stream); }
  Device on(cudaStream_t s) const {
    Device d = caller_;
    d.stream = s;
    return d;
  }

  Device caller_;
  cuda::DeviceGuard guard_;
  LaneStreams streams_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

std::unique_ptr<StreamLanes> make_stream_lanes(const Device& caller) {
  return std::make_unique<CudaStreamLanes>(caller);
}

}  // namespace qcoll
