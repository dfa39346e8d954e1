// Bulk dtype <-> fp32 conversion for the CPU kernels: short loops the compiler vectorizes,
// working on small chunks that stay in L1.
#pragma once

#include <cstdint>
#include <cstring>

#include "qcoll/dtype.h"
#include "qcoll/quant_math.h"

namespace qcoll {
namespace cpu {

inline void load_as_float(const void* src, DType t, int64_t n, float* dst) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      uint32_t* d = reinterpret_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
      return;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = math::half_bits_to_float(s[i]);
      return;
    }
  }
}

inline void store_from_float(const float* src, DType t, int64_t n, void* dst) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = math::float_to_bf16_bits(src[i]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = math::float_to_half_bits(src[i]);
      return;
    }
  }
}

}  // namespace cpu
}  // namespace qcoll
