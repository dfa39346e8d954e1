// Fiber contexts of the SIMT executor: a stack plus the registers to resume it. On x86-64 a
// switch saves the callee-saved registers and the float control words in a few
// instructions (ucontext's swapcontext also makes a signal-mask system call per switch,
// which dominated the emulator's run time); other ISAs use ucontext.
#pragma once

#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace qcoll {
namespace emu {

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;  // the saved stack pointer; registers are on that stack
#else
  ucontext_t uc;
#endif
};

// Prepares `c` to run entry() (which must never return) on [stack, stack + bytes).
void context_make(Context& c, unsigned char* stack, size_t bytes, void (*entry)());
// Saves the running context into `from` and resumes `to`.
void context_switch(Context& from, Context& to);

}  // namespace emu
}  // namespace qcoll
