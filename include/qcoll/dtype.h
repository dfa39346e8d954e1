// Element types the core understands. The integer codes are part of the binding ABI
// (exported as _C.DTYPES, read by python/qcoll/_dtypes.py); never renumber.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qcoll {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  // Raw bytes (any element type, moved as bytes): only unquantized transport, never a kernel.
  kBytes = 3,
};

inline constexpr size_t dtype_size(DType t) {
  return t == DType::kFloat32 ? 4 : t == DType::kBytes ? 1 : 2;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kBytes: return "bytes";
  }
  return "unknown";
}

// A floating dtype: what the kernels quantize, reduce and convert.
inline bool dtype_valid(int32_t code) { return code >= 0 && code <= 2; }
// Any element type a chunk may carry unquantized (the floats, or raw bytes).
inline bool raw_dtype_valid(int32_t code) { return code >= 0 && code <= 3; }

}  // namespace qcoll
