// Fiber contexts (context.h).
#include "emu/context.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
// qcoll_emu_switch(void** save_sp, void* new_sp): System V x86-64. Pushes the callee-saved
// registers and MXCSR / x87 control word, stores rsp, loads the other stack, pops the same.
// qcoll_emu_start: where a fresh context "returns" to: calls the entry in r12.
asm(R"(
  .text
  .globl qcoll_emu_switch
  .hidden qcoll_emu_switch
  .type qcoll_emu_switch, @function
qcoll_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size qcoll_emu_switch, .-qcoll_emu_switch

  .globl qcoll_emu_start
  .hidden qcoll_emu_start
  .type qcoll_emu_start, @function
qcoll_emu_start:
  callq *%r12
  ud2
  .size qcoll_emu_start, .-qcoll_emu_start
)");

extern "C" void qcoll_emu_switch(void** save_sp, void* new_sp);
extern "C" void qcoll_emu_start();
#endif

namespace qcoll {
namespace emu {

#if defined(__x86_64__)
void context_make(Context& c, unsigned char* stack, size_t bytes, void (*entry)()) {
  // The frame qcoll_emu_switch pops: control words, r15..r12, rbx, rbp, return address;
  // after the return rsp is 16-byte aligned, as a call to entry expects.
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t{15};
  uint64_t* f = reinterpret_cast<uint64_t*>(top) - 8;
  const uint32_t control[2] = {0x1f80u, 0x037fu};  // default MXCSR, x87 control word
  std::memcpy(&f[0], control, 8);
  f[1] = f[2] = f[3] = 0;                        // r15, r14, r13
  f[4] = reinterpret_cast<uint64_t>(entry);      // r12
  f[5] = f[6] = 0;                               // rbx, rbp
  f[7] = reinterpret_cast<uint64_t>(&qcoll_emu_start);
  c.sp = f;
}

void context_switch(Context& from, Context& to) { qcoll_emu_switch(&from.sp, to.sp); }
#else
void context_make(Context& c, unsigned char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

}  // namespace emu
}  // namespace qcoll
