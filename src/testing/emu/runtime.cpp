// The SIMT executor (runtime.h): blocks one after another, a block's threads as fibers that
// switch only at __syncthreads and warp collectives, and the checks on every access.
#include "emu/runtime.h"

#include "emu/context.h"

#include <link.h>
#include <sys/mman.h>

#include <algorithm>
#include <random>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define QCOLL_EMU_ASAN 1
#endif

namespace qcoll {
namespace emu {

#if defined(QCOLL_EMU_STREAMS)
thread_local bool g_in_kernel = false;
#else
bool g_in_kernel = false;
#endif

namespace {

#if defined(QCOLL_EMU_ASAN)
constexpr size_t kStackBytes = size_t{1} << 20;  // ASan's redzones and fake frames
#else
constexpr size_t kStackBytes = size_t{1} << 16;
#endif
constexpr size_t kPage = 4096;
constexpr int kWarp = 32;
constexpr unsigned kMaxThreads = 1024;

enum class State { kRunnable, kBarrier, kShuffle, kExited };

struct Fiber {
  Context ctx;
  unsigned char* stack = nullptr;  // kStackBytes usable, a guard page below
  unsigned tid = 0;
  State state = State::kRunnable;
  const char* file = nullptr;  // barrier or collective call site
  int line = 0;
  unsigned mask = 0;  // pending collective
  int lane_mask = 0;
  int width = 0;
  uint64_t value = 0, result = 0;
  void* fake = nullptr;  // ASan's fake stack of this fiber
};

// Per byte of shared memory: who touched it since the last barrier (`epoch`).
struct ByteState {
  uint64_t epoch = 0;
  int writer = -1;
  int reader = -1;
  bool many_readers = false;
};

// An open warp collective: the lanes of `mask` that have arrived.
struct Collective {
  unsigned mask;
  unsigned arrived;
  const char* file;
  int line;
  unsigned first_lane;
};

struct Runtime {
  Config config;
  std::vector<Buffer> buffers;
  // Per buffer and byte, who accessed it in this launch (see global_access); sized on the
  // buffer's first access of a launch, unused when blocks are sampled.
  std::vector<std::vector<uint32_t>> owners;
  std::vector<LaunchRecord> launches;
  std::vector<std::pair<uintptr_t, size_t>> writes;

  // The launch in progress.
  const KernelCall* call = nullptr;
  dim3 grid;  // as run: call->grid, or capped by config.grid_cap
  std::string kernel;
  unsigned nthreads = 0;
  uint3 block{0, 0, 0};
  uint64_t block_linear = 0;
  bool sampled = false;  // a sample of the blocks runs: no global race tracking
  std::vector<Fiber> fibers;
  std::vector<unsigned char*> stacks;  // kept for the next launches
  Fiber* current = nullptr;
  Context scheduler;
  std::vector<unsigned> ready;  // runnable threads, and each thread's index in it (or -1)
  std::vector<int> ready_at;
  std::string error;
  std::vector<std::vector<Collective>> warps;
  std::unordered_map<uintptr_t, ByteState> shared;
  std::unordered_set<uintptr_t> shared_written;  // bytes written in this block
  uint64_t epoch = 1;
  std::mt19937_64 rng;

  // The emulator module's writable data segment, where the __shared__ statics live.
  uintptr_t data_lo = 0, data_hi = 0;
};

Runtime& rt() {
  // Never destroyed: in the virtual-GPU build a stream thread may still be running a grid
  // while the process exits, and a static destructor would free what it is using.
  static Runtime* r = new Runtime;
  return *r;
}

// An object in this module's writable data segment, where its __shared__ statics live:
// find_data_segment finds the segment by this address (the Runtime is on the heap).
char g_data_segment_probe;

// ---- errors ---------------------------------------------------------------------------------------
std::string where(const Runtime& r, const Fiber* f) {
  std::ostringstream os;
  os << "kernel " << r.kernel << ", block (" << r.block.x << "," << r.block.y << "," << r.block.z
     << ")";
  if (f) os << ", thread " << f->tid;
  return os.str();
}

void switch_to_scheduler(Fiber* f, bool for_good);
void set_state(Runtime& r, Fiber& f, State s);

// A check failed: in a fiber, the fiber stops for good and the launch throws; on the host,
// it throws now.
[[noreturn]] void fail(const std::string& what) {
  Runtime& r = rt();
  Fiber* f = r.current;
  if (!f) throw EmuError("cuda_emu: " + what);
  r.error = "cuda_emu: " + what + " (" + where(r, f) + ")";
  switch_to_scheduler(f, /*for_good=*/false);
  std::abort();  // never resumed
}

std::string hex(uintptr_t a) {
  std::ostringstream os;
  os << "0x" << std::hex << a;
  return os.str();
}

std::string site(const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return std::string(base ? base + 1 : file) + ":" + std::to_string(line);
}

// ---- fibers -----------------------------------------------------------------------------------------
// Under AddressSanitizer every switch is announced, so ASan knows which stack is live.
#if defined(QCOLL_EMU_ASAN)
struct AsanStacks {
  const void* host_bottom = nullptr;
  size_t host_size = 0;
  void* host_fake = nullptr;
} g_asan;
void entering_fiber(const Fiber& f) {
  __sanitizer_start_switch_fiber(&g_asan.host_fake, f.stack, kStackBytes);
}
void entered_host() { __sanitizer_finish_switch_fiber(g_asan.host_fake, nullptr, nullptr); }
void leaving_fiber(Fiber& f, bool for_good) {
  __sanitizer_start_switch_fiber(for_good ? nullptr : &f.fake, g_asan.host_bottom,
                                 g_asan.host_size);
}
void entered_fiber(Fiber& f) {
  __sanitizer_finish_switch_fiber(f.fake, &g_asan.host_bottom, &g_asan.host_size);
}
#else
void entering_fiber(const Fiber&) {}
void entered_host() {}
void leaving_fiber(Fiber&, bool) {}
void entered_fiber(Fiber&) {}
#endif

void switch_to_scheduler(Fiber* f, bool for_good = false) {
  Runtime& r = rt();
  g_in_kernel = false;
  leaving_fiber(*f, for_good);
  context_switch(f->ctx, r.scheduler);
  entered_fiber(*f);
  g_in_kernel = true;
}

void fiber_main() {
  Runtime& r = rt();
  entered_fiber(*r.current);
  g_in_kernel = true;
  {
    alignas(16) unsigned char params[kMaxParamBytes];
    std::memcpy(params, r.call->params, r.call->params_bytes);
    r.call->invoke(params);
  }
  Fiber* f = r.current;
  set_state(r, *f, State::kExited);
  // A lane that exits while a collective waits for it never arrives.
  for (const Collective& c : r.warps[f->tid / kWarp])
    if (c.mask >> (f->tid % kWarp) & 1u)
      fail("lane " + std::to_string(f->tid % kWarp) + " exited, but __shfl_xor_sync at " +
           site(c.file, c.line) + " with mask " + hex(c.mask) +
           " waits for it (a mask naming an exited lane)");
  switch_to_scheduler(f, /*for_good=*/true);
}

unsigned char* new_stack() {
  void* p = mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw Error("cuda_emu: cannot map a fiber stack");
  mprotect(p, kPage, PROT_NONE);  // overflow faults instead of corrupting a neighbour
  return static_cast<unsigned char*>(p) + kPage;
}

// Moves a thread into state `s`, keeping the ready list in step.
void set_state(Runtime& r, Fiber& f, State s) {
  const bool was = f.state == State::kRunnable, is = s == State::kRunnable;
  f.state = s;
  if (was == is) return;
  if (is) {
    r.ready_at[f.tid] = static_cast<int>(r.ready.size());
    r.ready.push_back(f.tid);
  } else {
    const int at = r.ready_at[f.tid];
    r.ready[at] = r.ready.back();
    r.ready_at[r.ready[at]] = at;
    r.ready.pop_back();
    r.ready_at[f.tid] = -1;
  }
}

void start_fiber(Fiber& f) {
  Runtime& r = rt();
  f.state = State::kExited;
  set_state(r, f, State::kRunnable);
#if defined(QCOLL_EMU_ASAN)
  // The previous block's frames on this stack never returned: their poison is stale.
  ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);
  f.fake = nullptr;
#endif
  context_make(f.ctx, f.stack, kStackBytes, fiber_main);
}

void resume(Fiber& f) {
  Runtime& r = rt();
  r.current = &f;
  entering_fiber(f);
  context_switch(r.scheduler, f.ctx);
  entered_host();
  r.current = nullptr;
  g_in_kernel = false;
}

// ---- scheduling -------------------------------------------------------------------------------
Fiber* pick(Runtime& r, unsigned after) {
  if (r.ready.empty()) return nullptr;
  if (r.config.schedule == Schedule::kRandom) return &r.fibers[r.ready[r.rng() % r.ready.size()]];
  for (unsigned i = 0; i < r.nthreads; ++i) {  // thread order, continuing after the last one run
    Fiber& f = r.fibers[(after + i) % r.nthreads];
    if (f.state == State::kRunnable) return &f;
  }
  return nullptr;
}

// Nothing can run: release a barrier every thread reached, or report why the block is stuck.
void settle(Runtime& r) {
  const Fiber* barrier = nullptr;
  const Fiber* exited = nullptr;
  for (const Fiber& f : r.fibers) {
    if (f.state == State::kShuffle)
      throw EmuError("cuda_emu: __shfl_xor_sync at " + site(f.file, f.line) + " with mask " +
                     hex(f.mask) + " never completes: a lane it names waits at a "
                     "__syncthreads or in another collective (" + where(r, &f) + ")");
    if (f.state == State::kBarrier && !barrier) barrier = &f;
    if (f.state == State::kExited && !exited) exited = &f;
  }
  if (!barrier) return;  // all exited: the block is done
  if (exited)
    throw EmuError("cuda_emu: divergent __syncthreads: thread " + std::to_string(barrier->tid) +
                   " waits at " + site(barrier->file, barrier->line) + " but thread " +
                   std::to_string(exited->tid) + " exited without reaching it (" +
                   where(r, nullptr) + ")");
  for (const Fiber& f : r.fibers)
    if (f.file != barrier->file || f.line != barrier->line)
      throw EmuError("cuda_emu: divergent __syncthreads: thread " + std::to_string(barrier->tid) +
                     " waits at " + site(barrier->file, barrier->line) + ", thread " +
                     std::to_string(f.tid) + " at " + site(f.file, f.line) + " (" +
                     where(r, nullptr) + ")");
  for (Fiber& f : r.fibers) set_state(r, f, State::kRunnable);
  ++r.epoch;  // shared-memory accesses before the barrier no longer conflict
}

void run_block(Runtime& r, uint3 block, uint64_t linear) {
  r.block = block;
  r.block_linear = linear;
  r.shared.clear();
  r.shared_written.clear();
  for (auto& w : r.warps) w.clear();
  ++r.epoch;
  r.ready.clear();
  std::fill(r.ready_at.begin(), r.ready_at.end(), -1);
  for (Fiber& f : r.fibers) start_fiber(f);
  unsigned after = 0;
  for (;;) {
    Fiber* f = pick(r, after);
    if (!f) {
      settle(r);
      if (std::all_of(r.fibers.begin(), r.fibers.end(),
                      [](const Fiber& x) { return x.state == State::kExited; }))
        return;
      continue;
    }
    resume(*f);
    if (!r.error.empty()) throw EmuError(r.error);
    after = f->tid + 1;
  }
}

// The blocks a launch runs: all, or (max_blocks set and exceeded) the first two, the last
// two and a seeded sample of the rest, so grid-capped, grid-stride kernels are exercised at
// sizes past the cap without running every block.
std::vector<uint64_t> blocks_to_run(const Runtime& r, uint64_t total) {
  std::vector<uint64_t> ids;
  const uint64_t limit = static_cast<uint64_t>(r.config.max_blocks);
  if (limit == 0 || total <= limit || limit < 4) {
    for (uint64_t b = 0; b < total; ++b) ids.push_back(b);
  } else {
    ids = {0, 1, total - 2, total - 1};
    std::mt19937_64 g(r.config.seed ^ total);
    while (ids.size() < limit) {
      const uint64_t b = 2 + g() % (total - 4);
      if (std::find(ids.begin(), ids.end(), b) == ids.end()) ids.push_back(b);
    }
    std::sort(ids.begin(), ids.end());
  }
  if (r.config.schedule == Schedule::kRandom) {
    std::mt19937_64 g(r.config.seed * 0x9e3779b97f4a7c15ull + total);
    std::shuffle(ids.begin(), ids.end(), g);
  }
  return ids;
}

std::string kernel_name(const char* signature) {
  std::string s(signature);
  const std::string key = "Kernel = ";
  const size_t at = s.find(key);
  if (at == std::string::npos) return s;
  s = s.substr(at + key.size());
  const size_t end = s.find_first_of(";]");
  s = s.substr(0, end);
  for (const char* noise : {"qcoll::cuda::", "{anonymous}::", "team::", "(& ", "&"})
    for (size_t p; (p = s.find(noise)) != std::string::npos;) s.erase(p, std::strlen(noise));
  if (!s.empty() && s.back() == ')') s.pop_back();
  return s;
}

int find_data_segment(dl_phdr_info* info, size_t, void* out) {
  const uintptr_t probe = reinterpret_cast<uintptr_t>(&g_data_segment_probe);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_W)) continue;
    const uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
    if (probe >= lo && probe < hi) {
      static_cast<uintptr_t*>(out)[0] = lo;
      static_cast<uintptr_t*>(out)[1] = hi;
      return 1;
    }
  }
  return 0;
}

const Buffer* buffer_of(const Runtime& r, uintptr_t a, size_t bytes) {
  for (const Buffer& b : r.buffers)
    if (a >= b.base && a + bytes <= b.base + b.bytes) return &b;
  return nullptr;
}

// Between two launches nothing orders the threads of one: a byte that one thread writes
// must not be read or written by another thread of the same launch, nor written after
// another thread read it (atomics aside). Stricter than CUDA inside a block, where a
// __syncthreads would order the two; no kernel relies on that. Per byte, one word:
// 0 untouched, kManyReaders (read by several threads, written by none), else
// (1 + thread id) << 1 | written.
constexpr uint32_t kManyReaders = 0xffffffffu;

std::string thread_name(const Runtime& r, uint32_t id) {
  return "thread " + std::to_string(id % r.nthreads) + " of block " +
         std::to_string(id / r.nthreads);
}

void global_access(Runtime& r, const Buffer& b, uintptr_t a, size_t bytes, bool write) {
  if (r.sampled) return;
  std::vector<uint32_t>& owner = r.owners[&b - r.buffers.data()];
  if (owner.empty()) owner.assign(b.bytes, 0);
  const uint32_t id = static_cast<uint32_t>(r.block_linear * r.nthreads + r.current->tid);
  const uint32_t me = (id + 1) << 1;
  for (size_t i = 0; i < bytes; ++i) {
    uint32_t& v = owner[a - b.base + i];
    const auto race = [&](const std::string& by) {
      fail("global-memory race: " + std::string(write ? "write" : "read") + " of byte " +
           std::to_string(a - b.base + i) + " of buffer '" + b.name + "', " + by +
           " in this launch");
    };
    if (v == 0) {
      v = me | write;
    } else if (v == kManyReaders) {
      if (write) race("read by several threads");
    } else if ((v & ~1u) == me) {
      v |= write;
    } else if (v & 1u) {
      race("written by " + thread_name(r, (v >> 1) - 1));
    } else if (write) {
      race("read by " + thread_name(r, (v >> 1) - 1));
    } else {
      v = kManyReaders;
    }
  }
}

std::string describe_buffers(const Runtime& r) {
  std::ostringstream os;
  for (const Buffer& b : r.buffers)
    os << " " << b.name << "=[" << std::hex << "0x" << b.base << ", +" << std::dec << b.bytes
       << ")";
  return os.str();
}

void note_write(Runtime& r, uintptr_t a, size_t bytes) {
  if (!r.config.track_writes) return;
  if (!r.writes.empty() && r.writes.back().first + r.writes.back().second == a)
    r.writes.back().second += bytes;
  else
    r.writes.emplace_back(a, bytes);
}

void shared_access(Runtime& r, uintptr_t a, size_t bytes, bool write) {
  const int t = static_cast<int>(r.current->tid);
  for (size_t i = 0; i < bytes; ++i) {
    ByteState& s = r.shared[a + i];
    if (s.epoch != r.epoch) s = ByteState{r.epoch};
    const auto at = [&] { return "shared byte " + hex(a + i); };
    if (!write && !r.shared_written.count(a + i))
      fail("read of " + at() + ", which no thread of the block has written");
    if (s.writer >= 0 && s.writer != t)
      fail(std::string("shared-memory race: ") + (write ? "write" : "read") + " of " + at() +
           " written by thread " + std::to_string(s.writer) + " since the last __syncthreads");
    if (write && s.reader >= 0 && (s.reader != t || s.many_readers))
      fail("shared-memory race: write of " + at() + " read by thread " +
           std::to_string(s.reader != t ? s.reader : -1) + " (or others) since the last "
           "__syncthreads");
    if (write) {
      s.writer = t;
      r.shared_written.insert(a + i);
    } else if (s.reader < 0) {
      s.reader = t;
    } else if (s.reader != t) {
      s.many_readers = true;
    }
  }
}

}  // namespace

// ---- accesses ---------------------------------------------------------------------------------
void on_access(const void* p, size_t bytes, bool write, bool natural) {
  Runtime& r = rt();
  Fiber* f = r.current;
  if (!f) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(f->stack);
  if (a >= lo && a < lo + kStackBytes) return;  // the thread's own locals
  if (natural && bytes > 1 && a % bytes != 0)
    fail("misaligned " + std::to_string(bytes) + "-byte " + (write ? "store" : "load") +
         " at " + hex(a) + " (the device requires " + std::to_string(bytes) + "-byte alignment)");
  if (a >= r.data_lo && a < r.data_hi) return shared_access(r, a, bytes, write);
  const Buffer* b = buffer_of(r, a, bytes);
  if (!b && r.config.any_global) return;
  if (!b)
    fail("out-of-bounds global " + std::string(write ? "store" : "load") + " of " +
         std::to_string(bytes) + " bytes at " + hex(a) + "; buffers:" + describe_buffers(r));
  global_access(r, *b, a, bytes, write);
  if (write) note_write(r, a, bytes);
}

// ---- device-side interface --------------------------------------------------------------------
uint3 thread_idx() {
  const Runtime& r = rt();
  const unsigned t = r.current->tid;
  const dim3 b = r.call->block;
  return {t % b.x, t / b.x % b.y, t / (b.x * b.y)};
}
uint3 block_idx() { return rt().block; }
dim3 block_dim() { return rt().call->block; }
dim3 grid_dim() { return rt().grid; }

void sync_threads(const char* file, int line) {
  Runtime& r = rt();
  Fiber* f = r.current;
  set_state(r, *f, State::kBarrier);
  f->file = file;
  f->line = line;
  switch_to_scheduler(f);
}

uint64_t shfl_xor(unsigned mask, uint64_t value, int lane_mask, int width, const char* file,
                  int line) {
  Runtime& r = rt();
  Fiber* f = r.current;
  const unsigned lane = f->tid % kWarp, warp = f->tid / kWarp;
  const auto op = [&] { return "__shfl_xor_sync at " + site(file, line); };
  if (!(mask >> lane & 1u))
    fail(op() + ": the calling lane " + std::to_string(lane) + " is not in mask " + hex(mask));
  if (width < 1 || width > kWarp || (width & (width - 1)))
    fail(op() + ": width " + std::to_string(width) + " is not a power of two up to 32");
  const unsigned lanes_here = std::min<unsigned>(kWarp, r.nthreads - warp * kWarp);
  for (unsigned l = 0; l < kWarp; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (l >= lanes_here)
      fail(op() + ": mask " + hex(mask) + " names lane " + std::to_string(l) +
           ", which this block's last warp does not have");
    if (r.fibers[warp * kWarp + l].state == State::kExited)
      fail(op() + ": mask " + hex(mask) + " names lane " + std::to_string(l) + ", which has exited");
  }
  std::vector<Collective>& open = r.warps[warp];
  Collective* c = nullptr;
  for (Collective& o : open) {
    if (!(o.mask & mask)) continue;
    if (o.mask != mask || o.file != file || o.line != line)
      fail(op() + " with mask " + hex(mask) + " meets lane " + std::to_string(o.first_lane) +
           "'s collective at " + site(o.file, o.line) + " with mask " + hex(o.mask) +
           " (masks must agree across the lanes they name)");
    c = &o;
  }
  if (!c) {
    open.push_back(Collective{mask, 0u, file, line, lane});
    c = &open.back();
  }
  c->arrived |= 1u << lane;
  set_state(r, *f, State::kShuffle);
  f->file = file;
  f->line = line;
  f->mask = mask;
  f->lane_mask = lane_mask;
  f->width = width;
  f->value = value;
  if (c->arrived == mask) {  // every named lane has deposited: all read, then all go on
    for (unsigned l = 0; l < kWarp; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& dst = r.fibers[warp * kWarp + l];
      // PTX shfl.bfly: source lane l ^ lane_mask, own value past the end of l's segment.
      const unsigned src = l ^ static_cast<unsigned>(dst.lane_mask);
      const unsigned seg_end = (l / dst.width + 1) * dst.width - 1;
      if (src > seg_end || src >= kWarp) {
        dst.result = dst.value;
      } else {
        if (!(mask >> src & 1u))
          fail(op() + ": lane " + std::to_string(l) + " reads lane " + std::to_string(src) +
               ", which mask " + hex(mask) + " does not name");
        dst.result = r.fibers[warp * kWarp + src].value;
      }
      set_state(r, dst, State::kRunnable);
    }
    open.erase(open.begin() + (c - open.data()));
  }
  switch_to_scheduler(f);
  return f->result;
}

unsigned atomic_max_u32(unsigned* address, unsigned value) {
  Runtime& r = rt();
  const uintptr_t a = reinterpret_cast<uintptr_t>(address);
  if (a % 4) fail("misaligned 4-byte atomicMax at " + hex(a));
  if (!(a >= r.data_lo && a < r.data_hi) && !buffer_of(r, a, 4) && !r.config.any_global)
    fail("out-of-bounds atomicMax at " + hex(a) + "; buffers:" + describe_buffers(r));
  note_write(r, a, 4);
  const unsigned old = *address;  // one block at a time: atomic by construction
  *address = old > value ? old : value;
  return old;
}

void host_memset(void* p, int value, size_t bytes) {
  Runtime& r = rt();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (bytes && !buffer_of(r, a, bytes))
    throw EmuError("cuda_emu: cudaMemsetAsync of " + std::to_string(bytes) + " bytes at " +
                   hex(a) + " is outside the buffers:" + describe_buffers(r));
  std::memset(p, value, bytes);
  note_write(r, a, bytes);
}

// ---- configuration and launches ------------------------------------------------------------------
void configure(const Config& c) { rt().config = c; }
Config config() { return rt().config; }
void set_buffers(std::vector<Buffer> buffers) {
  rt().buffers = std::move(buffers);
  rt().owners.clear();
}

std::vector<LaunchRecord> take_launches() { return std::move(rt().launches); }

std::vector<std::pair<uintptr_t, size_t>> take_writes() {
  auto w = std::move(rt().writes);
  rt().writes.clear();
  std::sort(w.begin(), w.end());
  std::vector<std::pair<uintptr_t, size_t>> merged;
  for (const auto& [a, n] : w) {
    if (!merged.empty() && merged.back().first + merged.back().second >= a)
      merged.back().second = std::max(merged.back().second, a + n - merged.back().first);
    else
      merged.emplace_back(a, n);
  }
  return merged;
}

void run(const KernelCall& call) {
  Runtime& r = rt();
  if (!r.data_hi) {
    uintptr_t seg[2] = {0, 0};
    dl_iterate_phdr(find_data_segment, seg);
    r.data_lo = seg[0];
    r.data_hi = seg[1];
  }
  r.kernel = kernel_name(call.signature);
  const uint64_t threads = uint64_t{call.block.x} * call.block.y * call.block.z;
  dim3 grid = call.grid;
  const uint64_t cap = static_cast<uint64_t>(r.config.grid_cap);
  if (cap && grid.y == 1 && grid.z == 1 && grid.x > cap) grid.x = static_cast<unsigned>(cap);
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  if (threads == 0 || threads > kMaxThreads || blocks == 0 || call.grid.y > 65535 ||
      call.grid.z > 65535 || call.grid.x > 0x7fffffffu)
    throw EmuError("cuda_emu: invalid launch configuration of kernel " + r.kernel + ": grid (" +
                   std::to_string(call.grid.x) + "," + std::to_string(call.grid.y) + "," +
                   std::to_string(call.grid.z) + "), block of " + std::to_string(threads) +
                   " threads (cudaErrorInvalidConfiguration)");
  r.call = &call;
  r.grid = grid;
  r.nthreads = static_cast<unsigned>(threads);
  while (r.stacks.size() < threads) r.stacks.push_back(new_stack());
  r.fibers.assign(threads, Fiber{});
  r.ready.clear();
  r.ready_at.assign(threads, -1);
  for (unsigned t = 0; t < threads; ++t) {
    r.fibers[t].tid = t;
    r.fibers[t].stack = r.stacks[t];
  }
  r.warps.assign((threads + kWarp - 1) / kWarp, {});
  r.rng.seed(r.config.seed);
  r.error.clear();

  const auto ids = blocks_to_run(r, blocks);
  r.sampled = ids.size() < blocks;
  if (!r.sampled && blocks * threads >= (uint64_t{1} << 30))
    throw EmuError("cuda_emu: kernel " + r.kernel + " launches " + std::to_string(blocks * threads) +
                   " threads; the race check tracks fewer than 2^30 (configure max_blocks)");
  r.owners.resize(r.buffers.size());
  for (auto& o : r.owners) o.clear();
  struct Done {  // the launch is over, however it ends
    ~Done() { rt().call = nullptr; }
  } done;
  for (uint64_t b : ids)
    run_block(r,
              uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                    static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y))},
              b);
  r.launches.push_back(LaunchRecord{r.kernel, grid, call.block, static_cast<int64_t>(ids.size()),
                                    call.grid.x});
}

}  // namespace emu
}  // namespace qcoll
