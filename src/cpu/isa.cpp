#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace qcoll {
namespace cpu {
namespace {

bool supported(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
    case Isa::kBaseline: return true;
  }
  return false;
#else
  return isa == Isa::kBaseline;
#endif
}

Isa detect() {
  Isa best = supported(Isa::kAvx512) ? Isa::kAvx512 : supported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kBaseline;
  Isa cap;
  const char* env = std::getenv("QCOLL_CPU_ISA");
  if (env && *env && parse_isa(env, &cap) && static_cast<int>(cap) < static_cast<int>(best)) best = cap;
  return best;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kBaseline: return "baseline";
  }
  return "unknown";
}

bool parse_isa(const char* name, Isa* out) {
  for (Isa i : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512})
    if (std::strcmp(name, isa_name(i)) == 0) {
      *out = i;
      return true;
    }
  return false;
}

Isa best_isa() {
  static const Isa best = detect();
  return best;
}

bool set_isa(Isa isa) {
  if (!supported(isa)) return false;
  active_isa_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
  return true;
}

}  // namespace cpu
}  // namespace qcoll
