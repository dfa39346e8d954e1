// The emulated CUDA runtime of the virtual-GPU build (cuda_runtime_api.h says what it is).
// All state lives in one never-destroyed registry: stream threads may still run while the
// process exits, so nothing they touch is torn down by static destructors.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime_api.h"
#include "stream_work.h"

struct CUgraph_st;
struct CUgraphExec_st;

namespace qcoll {
namespace vgpu {
namespace {

struct Capture;

// One recorded piece of work and the nodes it depends on.
struct Node {
  std::function<void()> work;
  std::string what;
  std::vector<int> deps;
};

}  // namespace
}  // namespace vgpu
}  // namespace qcoll

// A capture in progress, and the graph it ends as.
struct CUgraph_st {
  std::vector<qcoll::vgpu::Node> nodes;
  unsigned long long id = 0;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;  // that began the capture
  bool invalidated = false;
  cudaError_t invalidated_by = cudaSuccess;
  bool ended = false;
  std::vector<CUstream_st*> streams;  // every stream in the capture, the origin first
};

struct CUgraphExec_st {
  std::vector<qcoll::vgpu::Node> nodes;  // in capture order, which respects every dependency
};

struct CUstream_st {
  std::thread worker;
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;   // jobs ever enqueued
  uint64_t completed = 0;  // jobs finished (in order)
  // Capture state (guarded by the registry mutex).
  CUgraph_st* capture = nullptr;
  std::vector<int> frontier;  // the capture's nodes the stream's next work depends on
};

struct CUevent_st {
  // Recorded outside a capture: complete once `stream` completed `ticket` jobs.
  cudaStream_t stream = nullptr;
  uint64_t ticket = 0;
  // Recorded inside a capture: the capture and the nodes that precede the record.
  CUgraph_st* capture = nullptr;
  std::vector<int> frontier;
};

namespace qcoll {
namespace vgpu {
namespace {

struct Registry {
  std::mutex mu;
  std::condition_variable progress;  // a job finished somewhere
  std::set<CUgraph_st*> captures;    // active captures
  unsigned long long next_capture_id = 1;
  std::string failure;               // sticky error's message
  std::atomic<bool> failed{false};
};

Registry& reg() {
  static Registry* r = new Registry;  // never destroyed (see above)
  return *r;
}

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaStreamCaptureMode t_mode = cudaStreamCaptureModeGlobal;

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;
  return e;
}

void fail_sticky(const std::string& why) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.failed) r.failure = why;
  r.failed = true;
}

void run_guarded(const std::function<void()>& work, const char* what) {
  if (reg().failed) return;  // a faulted device runs nothing more
  try {
    work();
  } catch (const std::exception& e) {
    fail_sticky(std::string(what) + ": " + e.what());
  } catch (...) {
    fail_sticky(std::string(what) + ": unknown exception");
  }
}

void worker_loop(cudaStream_t s) {
  Registry& r = reg();
  std::unique_lock<std::mutex> lock(r.mu);
  for (;;) {
    r.progress.wait(lock, [s] { return !s->queue.empty(); });
    std::function<void()> job = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    job();
    job = nullptr;  // its captures go before the stream is seen idle
    lock.lock();
    ++s->completed;
    r.progress.notify_all();
  }
}

// Whether a call that CUDA forbids during a capture ("potentially unsafe": synchronizing or
// querying) is refused for this thread under the capture modes; refusing invalidates the
// captures that forbid it. r.mu held.
bool refused_by_capture(Registry& r) {
  if (t_mode == cudaStreamCaptureModeRelaxed) return false;
  bool refused = false;
  const auto me = std::this_thread::get_id();
  for (CUgraph_st* c : r.captures) {
    if (c->mode == cudaStreamCaptureModeRelaxed) continue;
    const bool own = c->thread == me;
    const bool others_global = !own && c->mode == cudaStreamCaptureModeGlobal &&
                               t_mode == cudaStreamCaptureModeGlobal;
    if (own || others_global) {
      c->invalidated = true;
      c->invalidated_by = cudaErrorStreamCaptureUnsupported;
      refused = true;
    }
  }
  return refused;
}

bool event_done_locked(cudaEvent_t e) {
  return e->stream == nullptr || e->stream->completed >= e->ticket;
}

}  // namespace

cudaError_t enqueue(cudaStream_t stream, std::function<void()> work, const char* what) {
  Registry& r = reg();
  if (r.failed) return ret(cudaErrorLaunchFailure);
  if (stream == nullptr) {
    run_guarded(work, what);
    return ret(r.failed ? cudaErrorLaunchFailure : cudaSuccess);
  }
  std::lock_guard<std::mutex> lock(r.mu);
  if (CUgraph_st* c = stream->capture) {
    if (c->invalidated) return ret(cudaErrorStreamCaptureInvalidated);
    c->nodes.push_back(Node{std::move(work), what, stream->frontier});
    stream->frontier = {static_cast<int>(c->nodes.size()) - 1};
    return cudaSuccess;
  }
  std::string name = what;
  stream->queue.push_back([work = std::move(work), name] { run_guarded(work, name.c_str()); });
  ++stream->enqueued;
  r.progress.notify_all();
  return cudaSuccess;
}

std::string failure() {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.failure;
}

}  // namespace vgpu
}  // namespace qcoll

using qcoll::vgpu::reg;
using qcoll::vgpu::ret;
using qcoll::vgpu::Registry;

// ---- errors and device ---------------------------------------------------------------------
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal (the virtual GPU is device 0)";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnmatched: return "capture was not initiated in this stream";
    case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread: return "attempt to terminate a thread-local capture sequence from another thread";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = reg().failed ? cudaErrorLaunchFailure : qcoll::vgpu::t_last_error;
  qcoll::vgpu::t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  return reg().failed ? cudaErrorLaunchFailure : qcoll::vgpu::t_last_error;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
namespace {
thread_local int t_device = 0;
}
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return ret(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = 13000;  // the toolkit the real build uses
  return cudaSuccess;
}

// ---- streams ----------------------------------------------------------------------------------
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (!stream || (flags & ~cudaStreamNonBlocking)) return ret(cudaErrorInvalidValue);
  auto* s = new CUstream_st;
  s->worker = std::thread(qcoll::vgpu::worker_loop, s);
  s->worker.detach();  // streams live as long as the process (see the file comment)
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  // CUDA frees a stream once its work is done; its thread here simply idles for good.
  return stream ? cudaSuccess : ret(cudaErrorInvalidResourceHandle);
}

namespace {
cudaError_t wait_stream_locked(Registry& r, std::unique_lock<std::mutex>& lock, cudaStream_t s) {
  const uint64_t target = s->enqueued;
  r.progress.wait(lock, [&] { return s->completed >= target; });
  return r.failed ? cudaErrorLaunchFailure : cudaSuccess;
}
}  // namespace

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Registry& r = reg();
  std::unique_lock<std::mutex> lock(r.mu);
  if ((stream && stream->capture) || qcoll::vgpu::refused_by_capture(r))
    return ret(cudaErrorStreamCaptureUnsupported);
  if (!stream) return r.failed ? ret(cudaErrorLaunchFailure) : cudaSuccess;
  return ret(wait_stream_locked(r, lock, stream));
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if ((stream && stream->capture) || qcoll::vgpu::refused_by_capture(r))
    return ret(cudaErrorStreamCaptureUnsupported);
  if (r.failed) return ret(cudaErrorLaunchFailure);
  return !stream || stream->completed >= stream->enqueued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaDeviceSynchronize() {
  // Only the streams with work matter; the registry does not list them, so this waits
  // for the sticky state only. qcoll never calls it; the tests synchronize streams.
  return reg().failed ? ret(cudaErrorLaunchFailure) : cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (!event || flags != 0) return ret(cudaErrorInvalidValue);
  Registry& r = reg();
  std::unique_lock<std::mutex> lock(r.mu);
  if (r.failed) return ret(cudaErrorLaunchFailure);
  if (event->capture) {  // a captured event: fork `stream` into that capture, or join it
    CUgraph_st* c = event->capture;
    if (!stream) return ret(cudaErrorStreamCaptureImplicit);
    if (stream->capture && stream->capture != c) {
      stream->capture->invalidated = true;
      return ret(cudaErrorStreamCaptureIsolation);
    }
    if (c->ended) return ret(cudaErrorStreamCaptureUnmatched);
    if (!stream->capture) {
      stream->capture = c;
      stream->frontier = event->frontier;
      c->streams.push_back(stream);
    } else {
      for (int n : event->frontier)
        if (std::find(stream->frontier.begin(), stream->frontier.end(), n) == stream->frontier.end())
          stream->frontier.push_back(n);
    }
    return cudaSuccess;
  }
  if (stream && stream->capture) {
    // Captured work may depend on other captured work only: an event recorded outside the
    // capture would tie the graph to eager work.
    if (event->stream != nullptr) {
      stream->capture->invalidated = true;
      stream->capture->invalidated_by = cudaErrorStreamCaptureIsolation;
      return ret(cudaErrorStreamCaptureIsolation);
    }
    return cudaSuccess;  // never recorded (or on the host): nothing to wait for
  }
  if (event->stream == nullptr) return cudaSuccess;  // complete already
  if (!stream) {  // the host waits
    r.progress.wait(lock, [&] { return qcoll::vgpu::event_done_locked(event); });
    return r.failed ? ret(cudaErrorLaunchFailure) : cudaSuccess;
  }
  // The state at call time: a later record of the event does not move this wait.
  cudaStream_t src = event->stream;
  const uint64_t ticket = event->ticket;
  stream->queue.push_back([src, ticket] {
    Registry& rr = reg();
    std::unique_lock<std::mutex> l(rr.mu);
    rr.progress.wait(l, [&] { return src->completed >= ticket; });
  });
  ++stream->enqueued;
  r.progress.notify_all();
  return cudaSuccess;
}

// ---- events -------------------------------------------------------------------------------------
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (!event || (flags & ~cudaEventDisableTiming)) return ret(cudaErrorInvalidValue);
  *event = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event) return ret(cudaErrorInvalidResourceHandle);
  // A stream wait copied the event's state when it was enqueued: freeing is safe.
  std::lock_guard<std::mutex> lock(reg().mu);
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event) return ret(cudaErrorInvalidResourceHandle);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.failed) return ret(cudaErrorLaunchFailure);
  if (stream && stream->capture) {
    if (stream->capture->invalidated) return ret(cudaErrorStreamCaptureInvalidated);
    event->stream = nullptr;
    event->capture = stream->capture;
    event->frontier = stream->frontier;
    return cudaSuccess;
  }
  event->capture = nullptr;
  event->frontier.clear();
  event->stream = stream;  // the null stream: the host has done everything before
  event->ticket = stream ? stream->enqueued : 0;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event) return ret(cudaErrorInvalidResourceHandle);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (qcoll::vgpu::refused_by_capture(r)) return ret(cudaErrorStreamCaptureUnsupported);
  if (event->capture) return ret(cudaErrorCapturedEvent);
  if (r.failed) return ret(cudaErrorLaunchFailure);
  return qcoll::vgpu::event_done_locked(event) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event) return ret(cudaErrorInvalidResourceHandle);
  Registry& r = reg();
  std::unique_lock<std::mutex> lock(r.mu);
  if (qcoll::vgpu::refused_by_capture(r)) return ret(cudaErrorStreamCaptureUnsupported);
  if (event->capture) return ret(cudaErrorCapturedEvent);
  r.progress.wait(lock, [&] { return qcoll::vgpu::event_done_locked(event); });
  return r.failed ? ret(cudaErrorLaunchFailure) : cudaSuccess;
}

// ---- memory ----------------------------------------------------------------------------------
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault || (count && (!dst || !src)))
    return ret(cudaErrorInvalidValue);
  return qcoll::vgpu::enqueue(stream, [=] { std::memmove(dst, src, count); }, "cudaMemcpyAsync");
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t stream) {
  if (count && !dst) return ret(cudaErrorInvalidValue);
  return qcoll::vgpu::enqueue(stream, [=] { std::memset(dst, value, count); }, "cudaMemsetAsync");
}

// ---- capture and graphs ---------------------------------------------------------------------------
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (!stream) return ret(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot capture
  if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed)
    return ret(cudaErrorInvalidValue);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (stream->capture) return ret(cudaErrorIllegalState);
  auto* g = new CUgraph_st;
  g->id = r.next_capture_id++;
  g->mode = mode;
  g->thread = std::this_thread::get_id();
  stream->capture = g;
  stream->frontier.clear();
  g->streams.push_back(stream);
  r.captures.insert(g);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (!stream || !graph) return ret(cudaErrorInvalidValue);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  CUgraph_st* g = stream->capture;
  if (!g) return ret(cudaErrorIllegalState);
  *graph = nullptr;
  if (g->mode == cudaStreamCaptureModeThreadLocal && g->thread != std::this_thread::get_id())
    return ret(cudaErrorStreamCaptureWrongThread);
  // Every node must be an ancestor of (or one of) the origin's frontier: work of a forked
  // stream that was never joined back is an error.
  std::vector<char> reached(g->nodes.size(), 0);
  std::vector<int> todo = stream->frontier;
  while (!todo.empty()) {
    const int n = todo.back();
    todo.pop_back();
    if (reached[n]) continue;
    reached[n] = 1;
    for (int d : g->nodes[n].deps) todo.push_back(d);
  }
  const bool unjoined = std::find(reached.begin(), reached.end(), 0) != reached.end();
  if (stream != g->streams.front()) return ret(cudaErrorStreamCaptureUnmatched);
  for (CUstream_st* s : g->streams) {  // the forked streams leave the capture too
    s->capture = nullptr;
    s->frontier.clear();
  }
  g->ended = true;
  r.captures.erase(g);
  if (g->invalidated) return ret(cudaErrorStreamCaptureInvalidated);
  if (unjoined) return ret(cudaErrorStreamCaptureUnjoined);
  *graph = g;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  unsigned long long id = 0;
  return cudaStreamGetCaptureInfo(stream, status, &id);
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus* status,
                                     unsigned long long* id) {
  if (!status) return ret(cudaErrorInvalidValue);
  Registry& r = reg();
  std::lock_guard<std::mutex> lock(r.mu);
  CUgraph_st* g = stream ? stream->capture : nullptr;
  *status = !g ? cudaStreamCaptureStatusNone
               : g->invalidated ? cudaStreamCaptureStatusInvalidated
                                : cudaStreamCaptureStatusActive;
  if (id) *id = g ? g->id : 0;
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (!mode || *mode < cudaStreamCaptureModeGlobal || *mode > cudaStreamCaptureModeRelaxed)
    return ret(cudaErrorInvalidValue);
  std::swap(*mode, qcoll::vgpu::t_mode);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (!exec || !graph) return ret(cudaErrorInvalidValue);
  auto* e = new CUgraphExec_st;
  e->nodes = graph->nodes;
  *exec = e;
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!exec) return ret(cudaErrorInvalidValue);
  // One job runs the nodes in capture order (a topological order, the same on every rank,
  // so collectives recorded on several streams meet their peers in the same sequence).
  return qcoll::vgpu::enqueue(
      stream,
      [exec] {
        for (const auto& n : exec->nodes) n.work();
      },
      "cudaGraphLaunch");
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
