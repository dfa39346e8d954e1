// Every load and store of the emulated kernel code, delivered by the compiler: the kernel
// sources are compiled with -fsanitize=thread, which calls __tsan_readN / __tsan_writeN
// before each access, and this file (not the ThreadSanitizer runtime, which is never
// linked) implements those entry points by handing the access to the executor's checks.
// Outside a kernel (the launchers' host code) they return at once.
//
// __tsan_readN: an access of an N-byte type, which the device requires N-aligned;
// __tsan_unaligned_readN: the compiler knows less alignment (e.g. a memcpy of bytes), the
// device would use narrower accesses, so no alignment is required.
#include <cstddef>
#include <cstring>

#include "emu/runtime.h"

namespace {

inline void access(const void* p, size_t n, bool write, bool natural) {
  if (qcoll::emu::g_in_kernel) qcoll::emu::on_access(p, n, write, natural);
}

}  // namespace

#define QCOLL_EMU_HOOKS(N)                                                                   \
  extern "C" void __tsan_read##N(void* p) { access(p, N, false, true); }                    \
  extern "C" void __tsan_write##N(void* p) { access(p, N, true, true); }                    \
  extern "C" void __tsan_unaligned_read##N(void* p) { access(p, N, false, false); }         \
  extern "C" void __tsan_unaligned_write##N(void* p) { access(p, N, true, false); }

QCOLL_EMU_HOOKS(1)
QCOLL_EMU_HOOKS(2)
QCOLL_EMU_HOOKS(4)
QCOLL_EMU_HOOKS(8)
QCOLL_EMU_HOOKS(16)

extern "C" void __tsan_read_range(void* p, size_t n) { access(p, n, false, false); }
extern "C" void __tsan_write_range(void* p, size_t n) { access(p, n, true, false); }

// Clang turns memory intrinsics of instrumented code into these.
extern "C" void* __tsan_memcpy(void* d, const void* s, size_t n) {
  access(s, n, false, false);
  access(d, n, true, false);
  return std::memcpy(d, s, n);
}
extern "C" void* __tsan_memmove(void* d, const void* s, size_t n) {
  access(s, n, false, false);
  access(d, n, true, false);
  return std::memmove(d, s, n);
}
extern "C" void* __tsan_memset(void* d, int c, size_t n) {
  access(d, n, true, false);
  return std::memset(d, c, n);
}

// Bookkeeping calls the instrumentation also emits; nothing to do.
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_vptr_update(void**, void*) {}
extern "C" void __tsan_vptr_read(void**) {}
