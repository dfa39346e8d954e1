// Run-time ISA paths of the CPU kernels. Each hot range driver is compiled three times
// (QCOLL_ISA_VARIANTS) and the call goes to the widest path the CPU has; all paths do the
// same IEEE operations (no FMA: -ffp-contract=off), so their results are bit-identical.
#pragma once

#include <atomic>

namespace qcoll {
namespace cpu {

enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
// The widest path this CPU supports, capped by the environment variable QCOLL_CPU_ISA
// (baseline, avx2, avx512) when set.
Isa best_isa();
// The path the kernels take now (best_isa() until set_isa). Inline: the fp8 decode loops
// read it once per chunk or group (quant_loops.h: with_code_values).
inline std::atomic<int>& active_isa_slot() {
  static std::atomic<int> slot{static_cast<int>(best_isa())};
  return slot;
}
inline Isa active_isa() { return static_cast<Isa>(active_isa_slot().load(std::memory_order_relaxed)); }
// Forces a path (tests compare them bit for bit); returns false, changing nothing, when
// the CPU lacks it.
bool set_isa(Isa isa);
bool parse_isa(const char* name, Isa* out);

}  // namespace cpu
}  // namespace qcoll

// GCC/Clang on x86-64: the ISA sets of the two wider paths. Plain ISA flags, not arch=, so
// that every ordinary inline helper may still be inlined into them (GCC refuses to inline
// across differing arch= settings unless forced).
#if defined(__x86_64__) && defined(__GNUC__)
#define QCOLL_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,bmi,bmi2,prefer-vector-width=512")))
#define QCOLL_TARGET_AVX2 __attribute__((target("avx2,f16c,bmi,bmi2")))
#else
#define QCOLL_TARGET_AVX512
#define QCOLL_TARGET_AVX2
#endif

// Defines `void name params` that runs `body` (an always_inline function called with
// `args`) compiled for the active ISA path.
#define QCOLL_ISA_VARIANTS(name, body, params, args)                                  \
  QCOLL_TARGET_AVX512 __attribute__((noinline)) void name##_avx512 params { body args; } \
  QCOLL_TARGET_AVX2 __attribute__((noinline)) void name##_avx2 params { body args; }     \
  __attribute__((noinline)) void name##_baseline params { body args; }                  \
  void name params {                                                                     \
    switch (::qcoll::cpu::active_isa()) {                                                \
      case ::qcoll::cpu::Isa::kAvx512: return name##_avx512 args;                        \
      case ::qcoll::cpu::Isa::kAvx2: return name##_avx2 args;                            \
      default: return name##_baseline args;                                              \
    }                                                                                    \
  }
