// libnccl_emu.so: an NCCL stand-in for the virtual-GPU tests, with the C ABI subset that
// qcoll's loader binds (include/qcoll/nccl_api.h), loaded by that unchanged loader through
// QCOLL_NCCL_PATH. Test infrastructure only: qcoll itself runs on the real NCCL.
//
// Ranks are separate processes. A communicator is a POSIX shared-memory segment named in
// the unique id: a header (members joined, their pids, finalize count) and one channel per
// ordered pair of ranks, a single-slot queue of up to kChunk bytes. Operations are enqueued
// on the caller's emulated CUDA stream (src/testing/emu/cudart) and run there in stream order, as
// NCCL's kernels do; a stream's operation blocks that stream until its peers take part (or
// the communicator is aborted). Semantics kept from NCCL:
//  - ncclCommInitRankConfig with blocking = 0 returns ncclInProgress at once; joining is
//    done by a thread and ncclCommGetAsyncError reports ncclInProgress until every member
//    has joined; calls on a nonblocking communicator also report ncclInProgress until polled;
//  - ncclGroupStart/End: the operations of a group progress together (grouped sends and
//    receives cannot deadlock on each other); several sends to one peer match its receives
//    in order;
//  - in place: all-gather with sendbuff == recvbuff + rank * bytes, reduce-scatter with
//    recvbuff == sendbuff + rank * recvcount; other overlaps are rejected (NCCL leaves them
//    undefined);
//  - reductions as NCCL's ring computes them: rank r's block is reduced in the ring order
//    r+1, r+2, ..., r, each step rounded to the dtype (fp16/bf16 adds are correctly
//    rounded); ncclAvg is NCCL's pre-multiply by the dtype's 1/nranks for floating types and
//    sum-then-divide for integers;
//  - a peer process that exits makes ncclCommGetAsyncError report ncclRemoteError; the
//    operation itself waits, as a kernel would, until ncclCommAbort.
// Fault injection (tests): QCOLL_NCCL_EMU_FAULT=<kind>[:<op>[:<comm>]] in a rank's
// environment, for the <comm>-th communicator this process creates (default 0):
// "die" exits the process (_exit(71)) when its <op>-th operation starts on the stream,
// "stall" blocks that operation until abort, "never_join" never joins the init.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "emu/cudart/stream_work.h"
#include "qcoll/nccl_api.h"
#include "qcoll/quant_math.h"

namespace {

using Clock = std::chrono::steady_clock;

// nccl.h's values, as qcoll/nccl_api.h declares them.
using namespace qcoll::nccl;

constexpr int kVersion = 22803;  // reports itself as 2.28.3, the version qcoll is tested with
constexpr uint32_t kMagic = 0x71636e63;  // "qcnc"
constexpr size_t kChunk = 64 * 1024;
constexpr int kMaxRanks = 64;

struct UniqueId {
  uint32_t magic;
  char name[64];
  char pad[128 - 4 - 64];
};
static_assert(sizeof(UniqueId) == 128, "ncclUniqueId is 128 bytes");

struct Channel {
  std::atomic<uint64_t> posted;
  std::atomic<uint64_t> taken;
  uint64_t bytes;
  unsigned char data[kChunk];
};

struct Header {
  std::atomic<int> joined;
  std::atomic<int> finalized;
  std::atomic<int> pids[kMaxRanks];
};

size_t segment_bytes(int n) { return sizeof(Header) + sizeof(Channel) * size_t(n) * size_t(n); }

size_t dtype_bytes(int t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

thread_local std::string t_last_error;

ncclResult_t invalid(ncclResult_t r, const std::string& why) {
  t_last_error = why;
  return r;
}

struct Fault {
  std::string kind;  // "", "die", "stall", "never_join"
  int64_t op = 0;
};

std::atomic<int> g_comms_created{0};

Fault fault_for(int comm_index) {
  Fault f;
  const char* env = std::getenv("QCOLL_NCCL_EMU_FAULT");
  if (!env || !*env) return f;
  std::string s = env;
  std::vector<std::string> parts;
  size_t at = 0;
  for (;;) {
    const size_t colon = s.find(':', at);
    parts.push_back(s.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  const int comm = parts.size() > 2 ? std::atoi(parts[2].c_str()) : 0;
  if (comm != comm_index) return f;
  f.kind = parts[0];
  f.op = parts.size() > 1 ? std::atoll(parts[1].c_str()) : 0;
  return f;
}

// Whether `pid` still runs: an exited process that its parent has not reaped yet is a
// zombie, which kill(pid, 0) still finds.
bool process_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;  // no procfs: kill's answer stands
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* end = std::strrchr(buf, ')');  // "pid (name) state ..."
  return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

struct Comm;

// One transfer of a group: bytes to or from a peer's channel.
struct Transfer {
  bool send;
  int peer;
  unsigned char* ptr;
  size_t bytes;
  size_t done = 0;
};

struct Comm {
  int rank = 0, nranks = 0;
  bool blocking = true;
  std::string name;
  Header* header = nullptr;
  Channel* channels = nullptr;
  size_t mapped = 0;
  std::atomic<int> state{ncclInProgress};  // what ncclCommGetAsyncError reports
  std::atomic<bool> aborted{false};
  std::atomic<bool> settling{false};  // a nonblocking call reported ncclInProgress
  std::atomic<int64_t> ops{0};        // operations started on the stream
  std::atomic<int> running{0};        // operations executing now
  std::atomic<int> queued{0};         // eager operations enqueued and not finished
  Fault fault;
  std::thread init;
  std::mutex exec;  // one operation of this communicator at a time

  Channel& channel(int src, int dst) { return channels[size_t(src) * nranks + dst]; }

  ~Comm() {
    if (init.joinable()) init.join();
    if (header) munmap(header, mapped);
  }

  // Checks between polls: abort, a dead peer. Returns false when the wait must end.
  bool keep_waiting() {
    if (aborted) return false;
    for (int p = 0; p < nranks; ++p) {
      const int pid = header->pids[p].load();
      if (p != rank && pid > 0 && !process_alive(pid)) {
        int expected = ncclSuccess;
        state.compare_exchange_strong(expected, ncclRemoteError);
      }
    }
    return true;
  }

  // Moves every transfer to completion, all together; false when aborted.
  bool progress(std::vector<Transfer>& ts) {
    auto sleep = std::chrono::microseconds(20);
    for (;;) {
      bool all = true, moved = false;
      std::vector<char> busy(size_t(nranks) * 2, 0);  // one active transfer per peer and way
      for (Transfer& t : ts) {
        if (t.done == t.bytes) continue;
        char& b = busy[size_t(t.peer) * 2 + (t.send ? 1 : 0)];
        if (b) {
          all = false;
          continue;
        }
        b = 1;
        all = false;
        Channel& c = t.send ? channel(rank, t.peer) : channel(t.peer, rank);
        const uint64_t posted = c.posted.load(std::memory_order_acquire);
        const uint64_t taken = c.taken.load(std::memory_order_acquire);
        if (t.send && posted == taken) {
          const size_t n = std::min(kChunk, t.bytes - t.done);
          std::memcpy(c.data, t.ptr + t.done, n);
          c.bytes = n;
          c.posted.store(posted + 1, std::memory_order_release);
          t.done += n;
          moved = true;
        } else if (!t.send && posted > taken) {
          const size_t n = c.bytes;
          if (n > t.bytes - t.done) {
            state = ncclInternalError;
            t_last_error = "peer sent more bytes than this rank receives";
            return false;
          }
          std::memcpy(t.ptr + t.done, c.data, n);
          c.taken.store(taken + 1, std::memory_order_release);
          t.done += n;
          moved = true;
        }
      }
      if (all) return true;
      if (moved) {
        sleep = std::chrono::microseconds(20);
        continue;
      }
      if (!keep_waiting()) return false;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
    }
  }
};

// ---- reductions -------------------------------------------------------------------------------
// Rounds an exactly computed double to the nearest value of a float format with `digits`
// significand bits and smallest normal exponent `emin` (ties to even); overflow gives inf.
double round_to(double v, int digits, int emin, double max) {
  if (v == 0 || std::isnan(v) || std::isinf(v)) return v;
  int e = 0;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  const int quantum = std::max(e - digits, emin - digits + 1);
  double r = std::ldexp(std::nearbyint(std::ldexp(v, -quantum)), quantum);
  if (std::fabs(r) > max) r = std::copysign(INFINITY, v);
  return r;
}

template <typename T>
struct Scalar;  // load/store as double for fp16/bf16, native otherwise

double half_to_double(uint16_t h) { return qcoll::math::half_bits_to_float(h); }
double bf16_to_double(uint16_t h) { return qcoll::math::bf16_bits_to_float(h); }
uint16_t double_to_half(double v) {
  return qcoll::math::float_to_half_bits(static_cast<float>(round_to(v, 11, -14, 65504.0)));
}
uint16_t double_to_bf16(double v) {
  return qcoll::math::float_to_bf16_bits(
      static_cast<float>(round_to(v, 8, -126, 3.3895313892515355e38)));
}

template <typename T>
T apply(int op, T a, T b) {
  switch (op) {
    case ncclSum: case ncclAvg: return static_cast<T>(a + b);
    case ncclProd: return static_cast<T>(a * b);
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
  }
  return a;
}

// out[i] = the ring-ordered reduction of blocks[p][i], p = r+1, ..., r (mod n).
template <typename T>
void reduce_native(int op, const std::vector<const unsigned char*>& blocks, int r, size_t count,
                   unsigned char* out) {
  const int n = static_cast<int>(blocks.size());
  const bool premul = op == ncclAvg && std::is_floating_point_v<T>;
  const T scale = premul ? static_cast<T>(1.0 / n) : T(1);
  for (size_t i = 0; i < count; ++i) {
    T acc{};
    for (int k = 1; k <= n; ++k) {
      T x;
      std::memcpy(&x, blocks[(r + k) % n] + i * sizeof(T), sizeof(T));
      if (premul) x = x * scale;
      acc = k == 1 ? x : apply<T>(op, acc, x);
    }
    if (op == ncclAvg && !std::is_floating_point_v<T>) acc = static_cast<T>(acc / n);
    std::memcpy(out + i * sizeof(T), &acc, sizeof(T));
  }
}

void reduce_16(int op, bool bf16, const std::vector<const unsigned char*>& blocks, int r,
               size_t count, unsigned char* out) {
  const int n = static_cast<int>(blocks.size());
  auto load = [bf16](const unsigned char* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return bf16 ? bf16_to_double(h) : half_to_double(h);
  };
  auto store = [bf16](double v) { return bf16 ? double_to_bf16(v) : double_to_half(v); };
  auto rounded = [&](double v) { return bf16 ? bf16_to_double(double_to_bf16(v)) : half_to_double(double_to_half(v)); };
  const double scale = rounded(1.0 / n);  // the dtype's 1/nranks
  for (size_t i = 0; i < count; ++i) {
    double acc = 0;
    for (int k = 1; k <= n; ++k) {
      double x = load(blocks[(r + k) % n] + i * 2);
      if (op == ncclAvg) x = rounded(x * scale);
      acc = k == 1 ? x : rounded(apply<double>(op, acc, x));
    }
    const uint16_t bits = store(acc);
    std::memcpy(out + i * 2, &bits, 2);
  }
}

void reduce(int type, int op, const std::vector<const unsigned char*>& blocks, int r,
            size_t count, unsigned char* out) {
  switch (type) {
    case ncclInt8: return reduce_native<int8_t>(op, blocks, r, count, out);
    case ncclUint8: return reduce_native<uint8_t>(op, blocks, r, count, out);
    case ncclInt32: return reduce_native<int32_t>(op, blocks, r, count, out);
    case ncclUint32: return reduce_native<uint32_t>(op, blocks, r, count, out);
    case ncclInt64: return reduce_native<int64_t>(op, blocks, r, count, out);
    case ncclUint64: return reduce_native<uint64_t>(op, blocks, r, count, out);
    case ncclFloat32: return reduce_native<float>(op, blocks, r, count, out);
    case ncclFloat64: return reduce_native<double>(op, blocks, r, count, out);
    case ncclFloat16: return reduce_16(op, false, blocks, r, count, out);
    case ncclBfloat16: return reduce_16(op, true, blocks, r, count, out);
  }
}

// ---- operations and groups ---------------------------------------------------------------------
struct Op {
  enum Kind { kSend, kRecv, kAllGather, kReduceScatter } kind;
  const unsigned char* send;
  unsigned char* recv;
  size_t count;  // elements (per rank for the collectives)
  int type;
  int redop;
  int peer;
  std::shared_ptr<Comm> comm;
  cudaStream_t stream;
};

// Runs one communicator's operations of a group (or one operation) on its stream.
void execute(Comm& c, std::vector<Op>& ops) {
  std::lock_guard<std::mutex> lock(c.exec);
  const int64_t number = c.ops++;
  if (c.aborted) return;
  if (c.fault.op == number && c.fault.kind == "die") _exit(71);
  if (c.fault.op == number && c.fault.kind == "stall") {
    while (!c.aborted) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return;
  }
  std::vector<Transfer> ts;
  std::vector<std::vector<unsigned char>> staging;
  struct Reduce {
    const Op* op;
    std::vector<const unsigned char*> blocks;
  };
  std::vector<Reduce> reduces;
  for (const Op& op : ops) {
    const size_t es = dtype_bytes(op.type);
    const size_t bytes = op.count * es;
    switch (op.kind) {
      case Op::kSend:
        ts.push_back({true, op.peer, const_cast<unsigned char*>(op.send), bytes});
        break;
      case Op::kRecv:
        ts.push_back({false, op.peer, op.recv, bytes});
        break;
      case Op::kAllGather:
        if (op.send != op.recv + size_t(c.rank) * bytes)
          std::memcpy(op.recv + size_t(c.rank) * bytes, op.send, bytes);
        for (int p = 0; p < c.nranks; ++p) {
          if (p == c.rank) continue;
          ts.push_back({true, p, const_cast<unsigned char*>(op.send), bytes});
          ts.push_back({false, p, op.recv + size_t(p) * bytes, bytes});
        }
        break;
      case Op::kReduceScatter: {
        Reduce red{&op, std::vector<const unsigned char*>(c.nranks)};
        for (int p = 0; p < c.nranks; ++p) {
          if (p == c.rank) {
            red.blocks[p] = op.send + size_t(c.rank) * bytes;
            continue;
          }
          ts.push_back({true, p, const_cast<unsigned char*>(op.send) + size_t(p) * bytes, bytes});
          staging.emplace_back(bytes);
          ts.push_back({false, p, staging.back().data(), bytes});
          red.blocks[p] = staging.back().data();
        }
        reduces.push_back(std::move(red));
        break;
      }
    }
  }
  if (!c.progress(ts)) return;
  for (const Reduce& red : reduces) {
    const Op& op = *red.op;
    // In place the output is this rank's own input block: reduce into a copy first.
    std::vector<unsigned char> out(op.count * dtype_bytes(op.type));
    reduce(op.type, op.redop, red.blocks, c.rank, op.count, out.data());
    std::memcpy(op.recv, out.data(), out.size());
  }
}

struct GroupState {
  int depth = 0;
  std::vector<Op> ops;
  ncclResult_t error = ncclSuccess;
};
thread_local GroupState t_group;

ncclResult_t submit(std::vector<Op> ops) {
  // One job per communicator, on the stream of its first operation.
  std::vector<std::shared_ptr<Comm>> comms;
  for (const Op& op : ops)
    if (std::find(comms.begin(), comms.end(), op.comm) == comms.end()) comms.push_back(op.comm);
  ncclResult_t result = ncclSuccess;
  for (const auto& comm : comms) {
    std::vector<Op> mine;
    for (const Op& op : ops)
      if (op.comm == comm) mine.push_back(op);
    const cudaStream_t stream = mine.front().stream;
    for (const Op& op : mine)
      if (op.stream != stream)
        return invalid(ncclInvalidUsage, "nccl_emu: one communicator's operations of a group must "
                                      "share one stream");
    // An operation captured into a CUDA graph runs at each replay; only eager ones are
    // waited for by finalize.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(stream, &capture);
    auto counted = std::make_shared<std::atomic<bool>>(capture == cudaStreamCaptureStatusNone);
    if (*counted) comm->queued++;
    auto job = [comm, mine, counted]() mutable {
      comm->running++;
      execute(*comm, mine);
      comm->running--;
      if (counted->exchange(false)) comm->queued--;
    };
    if (qcoll::vgpu::enqueue(stream, std::move(job), "NCCL operation") != cudaSuccess)
      return invalid(ncclUnhandledCudaError, "nccl_emu: the CUDA stream refused the operation: " +
                                              qcoll::vgpu::failure());
    if (!comm->blocking) {
      comm->settling = true;
      result = ncclInProgress;
    }
  }
  return result;
}

ncclResult_t add(Op op) {
  if (!op.comm) return invalid(ncclInvalidArgument, "nccl_emu: null communicator");
  if (op.comm->aborted) return invalid(ncclInvalidUsage, "nccl_emu: communicator was aborted");
  if (op.comm->state == ncclInProgress && !op.comm->settling)
    return invalid(ncclInvalidUsage, "nccl_emu: communicator is still being initialized");
  if (dtype_bytes(op.type) == 0) return invalid(ncclInvalidArgument, "nccl_emu: invalid datatype");
  if (op.redop < ncclSum || op.redop > ncclAvg) return invalid(ncclInvalidArgument, "nccl_emu: invalid op");
  if ((op.kind == Op::kSend || op.kind == Op::kRecv) &&
      (op.peer < 0 || op.peer >= op.comm->nranks))
    return invalid(ncclInvalidArgument, "nccl_emu: peer out of range");
  if (t_group.depth > 0) {
    t_group.ops.push_back(std::move(op));
    return ncclSuccess;
  }
  return submit({std::move(op)});
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

struct Handle {
  std::shared_ptr<Comm> comm;
};

}  // namespace

extern "C" {

int ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = kVersion;
  return ncclSuccess;
}

int ncclGetUniqueId(UniqueId* id) {
  if (!id) return ncclInvalidArgument;
  std::memset(id, 0, sizeof(*id));
  id->magic = kMagic;
  std::random_device rd;
  std::snprintf(id->name, sizeof(id->name), "/qcoll-nccl-emu-%d-%08x%08x", getpid(), rd(), rd());
  return ncclSuccess;
}

const char* ncclGetErrorString(int r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* ncclGetLastError(ncclComm_t) { return t_last_error.c_str(); }

int ncclCommInitRankConfig(ncclComm_t* out, int nranks, UniqueId id, int rank, ncclConfigV21400* config) {
  if (!out) return invalid(ncclInvalidArgument, "nccl_emu: comm is null");
  *out = nullptr;
  if (id.magic != kMagic) return invalid(ncclInvalidArgument, "nccl_emu: not a unique id of nccl_emu");
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
    return invalid(ncclInvalidArgument, "nccl_emu: invalid rank or nranks");
  auto comm = std::make_shared<Comm>();
  comm->rank = rank;
  comm->nranks = nranks;
  comm->blocking = !(config && config->blocking == 0);
  comm->name = id.name;
  comm->fault = fault_for(g_comms_created++);
  comm->mapped = segment_bytes(nranks);
  const int fd = shm_open(id.name, O_CREAT | O_RDWR, 0600);
  if (fd < 0) return invalid(ncclSystemError, std::string("nccl_emu: shm_open: ") + std::strerror(errno));
  // Every member sizes it the same; a fresh segment is zero-filled.
  if (ftruncate(fd, static_cast<off_t>(comm->mapped)) != 0) {
    close(fd);
    return invalid(ncclSystemError, std::string("nccl_emu: ftruncate: ") + std::strerror(errno));
  }
  void* p = mmap(nullptr, comm->mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return invalid(ncclSystemError, std::string("nccl_emu: mmap: ") + std::strerror(errno));
  comm->header = static_cast<Header*>(p);
  comm->channels = reinterpret_cast<Channel*>(static_cast<unsigned char*>(p) + sizeof(Header));
  Comm* c = comm.get();
  auto join = [c] {
    if (c->fault.kind == "never_join") return;  // stays in progress until aborted
    c->header->pids[c->rank] = getpid();
    c->header->joined++;
    while (c->header->joined.load() < c->nranks) {
      if (c->aborted) return;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (c->rank == 0) shm_unlink(c->name.c_str());  // every member has it mapped
    int expected = ncclInProgress;
    c->state.compare_exchange_strong(expected, ncclSuccess);
  };
  *out = reinterpret_cast<ncclComm_t>(new Handle{comm});
  if (comm->blocking) {
    join();
    return comm->state.load();
  }
  comm->init = std::thread(join);
  return ncclInProgress;
}

int ncclCommInitRank(ncclComm_t* out, int nranks, UniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

int ncclCommGetAsyncError(ncclComm_t handle, int* async) {
  if (!handle || !async) return ncclInvalidArgument;
  Comm& c = *reinterpret_cast<Handle*>(handle)->comm;
  if (c.settling.exchange(false)) {  // a nonblocking call: in progress once, then settled
    *async = ncclInProgress;
    return ncclSuccess;
  }
  *async = c.state.load();
  return ncclSuccess;
}

int ncclGroupStart() {
  if (t_group.depth++ == 0) {
    t_group.ops.clear();
    t_group.error = ncclSuccess;
  }
  return ncclSuccess;
}

int ncclGroupEnd() {
  if (t_group.depth == 0) return invalid(ncclInvalidUsage, "nccl_emu: ncclGroupEnd without ncclGroupStart");
  if (--t_group.depth > 0) return ncclSuccess;
  std::vector<Op> ops = std::move(t_group.ops);
  t_group.ops.clear();
  if (ops.empty()) return ncclSuccess;
  return submit(std::move(ops));
}

int ncclSend(const void* buf, size_t count, int type, int peer, ncclComm_t handle, cudaStream_t stream) {
  if (!handle) return invalid(ncclInvalidArgument, "nccl_emu: null communicator");
  return add({Op::kSend, static_cast<const unsigned char*>(buf), nullptr, count, type, ncclSum, peer,
              reinterpret_cast<Handle*>(handle)->comm, stream});
}

int ncclRecv(void* buf, size_t count, int type, int peer, ncclComm_t handle, cudaStream_t stream) {
  if (!handle) return invalid(ncclInvalidArgument, "nccl_emu: null communicator");
  return add({Op::kRecv, nullptr, static_cast<unsigned char*>(buf), count, type, ncclSum, peer,
              reinterpret_cast<Handle*>(handle)->comm, stream});
}

int ncclAllGather(const void* send, void* recv, size_t count, int type, ncclComm_t handle,
                  cudaStream_t stream) {
  if (!handle) return invalid(ncclInvalidArgument, "nccl_emu: null communicator");
  const auto& comm = reinterpret_cast<Handle*>(handle)->comm;
  const size_t bytes = count * dtype_bytes(type);
  auto* r = static_cast<unsigned char*>(recv);
  if (send != r + size_t(comm->rank) * bytes && overlaps(send, bytes, recv, bytes * comm->nranks))
    return invalid(ncclInvalidArgument, "nccl_emu: ncclAllGather buffers overlap and are not in place");
  return add({Op::kAllGather, static_cast<const unsigned char*>(send), r, count, type, ncclSum, 0, comm,
              stream});
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op,
                      ncclComm_t handle, cudaStream_t stream) {
  if (!handle) return invalid(ncclInvalidArgument, "nccl_emu: null communicator");
  const auto& comm = reinterpret_cast<Handle*>(handle)->comm;
  const size_t bytes = count * dtype_bytes(type);
  auto* s = static_cast<const unsigned char*>(send);
  if (recv != s + size_t(comm->rank) * bytes && overlaps(recv, bytes, send, bytes * comm->nranks))
    return invalid(ncclInvalidArgument, "nccl_emu: ncclReduceScatter buffers overlap and are not in place");
  return add({Op::kReduceScatter, s, static_cast<unsigned char*>(recv), count, type, op, 0, comm, stream});
}

int ncclCommFinalize(ncclComm_t handle) {
  if (!handle) return ncclInvalidArgument;
  std::shared_ptr<Comm> comm = reinterpret_cast<Handle*>(handle)->comm;
  if (comm->state != ncclSuccess) return invalid(ncclInvalidUsage, "nccl_emu: finalize of a communicator that is not ready");
  // Nonblocking: flushing the queued operations and meeting every member happen on a thread.
  comm->state = ncclInProgress;
  Comm* c = comm.get();
  if (c->init.joinable()) c->init.join();
  c->init = std::thread([c] {
    while (c->queued.load() > 0) {  // flush: every eager operation has run
      if (c->aborted) return;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    c->header->finalized++;
    while (c->header->finalized.load() < c->nranks) {
      if (c->aborted) return;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    int expected = ncclInProgress;
    c->state.compare_exchange_strong(expected, ncclSuccess);
  });
  if (comm->blocking) {
    c->init.join();
    return comm->state.load();
  }
  return ncclInProgress;
}

int ncclCommDestroy(ncclComm_t handle) {
  if (!handle) return ncclInvalidArgument;
  delete reinterpret_cast<Handle*>(handle);  // the operations still queued hold the Comm
  return ncclSuccess;
}

int ncclCommAbort(ncclComm_t handle) {
  if (!handle) return ncclInvalidArgument;
  auto* h = reinterpret_cast<Handle*>(handle);
  Comm& c = *h->comm;
  c.aborted = true;
  // The running operation ends at its next poll; queued ones return at once.
  while (c.running.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  if (c.init.joinable()) c.init.join();
  if (c.rank == 0) shm_unlink(c.name.c_str());
  delete h;
  return ncclSuccess;
}

}  // extern "C"
