// The three Lanes of include/qcoll/lanes.h: serial, a CPU thread, CUDA streams.
#include "qcoll/lanes.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace qcoll {
namespace {

// One stage after another in the calling thread.
class SerialLanes final : public Lanes {
 public:
  explicit SerialLanes(const Device& d) : device_(d) {}
  Device intra() const override { return device_; }
  Device inter() const override { return device_; }
  void then_inter(std::function<void()> work) override { work(); }
  void join() override {}
  bool failed() const override { return false; }

 private:
  Device device_;
};

// Inter-node work runs in order on a thread of its own; the caller's thread is the intra
// lane, so an inter task enqueued after intra_hop(s) returned sees all of stage s's data.
class ThreadLanes final : public Lanes {
 public:
  // The lane runs kernels with the caller's OpenMP team size (torch.set_num_threads(1) in
  // the caller would otherwise not reach it: a new thread starts from the process default).
  explicit ThreadLanes(const Device& d)
      : device_(d), threads_(openmp_max_threads()), thread_([this] { run(); }) {}

  // Never leaves the thread running: pending tasks are dropped, the running one finishes
  // (a blocked exchange ends within its transport's timeout).
  ~ThreadLanes() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      tasks_.clear();
    }
    changed_.notify_all();
    thread_.join();
  }

  Device intra() const override { return device_; }
  Device inter() const override { return device_; }

  void then_inter(std::function<void()> work) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) return;  // the lane has failed; join() reports it
    tasks_.push_back(std::move(work));
    changed_.notify_all();
  }

  void join() override {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return (tasks_.empty() && !busy_) || error_; });
    if (error_) std::rethrow_exception(error_);
  }

  bool failed() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_ != nullptr;
  }

 private:
  void run() {
    set_openmp_threads(threads_);
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [this] { return closing_ || !tasks_.empty(); });
      if (closing_) return;
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        task();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      busy_ = false;
      if (error) {
        error_ = error;
        tasks_.clear();
      }
      changed_.notify_all();
    }
  }

  Device device_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool closing_ = false;
  std::exception_ptr error_;
  int threads_;
  std::thread thread_;  // last: started once every member above exists
};

// Both lanes enqueue from the calling thread onto two streams; the streams overlap.
class CudaLanes final : public Lanes {
 public:
  explicit CudaLanes(const Device& d) : streams_(make_stream_lanes(d)) {}
  // The caller's stream waits for both lanes on every path: work already enqueued must
  // finish before the caller's allocator may hand the workspace to anyone else.
  ~CudaLanes() override {
    if (joined_) return;
    try {
      streams_->join();
    } catch (...) {
    }
  }
  Device intra() const override { return streams_->intra(); }
  Device inter() const override { return streams_->inter(); }
  void then_inter(std::function<void()> work) override {
    streams_->inter_waits_for_intra();
    work();
  }
  void join() override {
    joined_ = true;
    streams_->join();
  }
  bool failed() const override { return false; }

 private:
  std::unique_ptr<StreamLanes> streams_;
  bool joined_ = false;
};

}  // namespace

std::unique_ptr<Lanes> make_lanes(const Device& caller, int stages, bool streams) {
  if (stages > 1 && caller.kind == DeviceKind::kCPU) return std::make_unique<ThreadLanes>(caller);
  if (stages > 1 && caller.kind == DeviceKind::kCUDA && streams)
    return std::make_unique<CudaLanes>(caller);
  return std::make_unique<SerialLanes>(caller);
}

}  // namespace qcoll
