// Element types the core understands. The integer codes are part of the binding ABI
// (python/qcoll/_dtypes.py mirrors them); never renumber.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qcoll {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
};

inline constexpr size_t dtype_size(DType t) {
  return t == DType::kFloat32 ? 4 : 2;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

inline bool dtype_valid(int32_t code) { return code >= 0 && code <= 2; }

}  // namespace qcoll
