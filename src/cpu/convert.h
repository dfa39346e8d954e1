// Bulk dtype <-> fp32 conversion for the CPU kernels: short loops the compiler vectorizes,
// working on small chunks that stay in L1.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qcoll/dtype.h"
#include "qcoll/quant_math.h"

// GCC >= 12 on x86-64 has a native half type: hardware conversions (F16C, AVX-512) in the
// wider clones, libgcc's exact software conversion otherwise.
#if defined(__x86_64__) && defined(__FLT16_MAX__) && !defined(__clang__)
#define QCOLL_HAS_FLOAT16 1
#endif

namespace qcoll {
namespace cpu {

// Calls f(std::integral_constant<DType, dtype>) for a float dtype: the CPU drivers fix the
// element type once per call, so the conversions below fold to one loop.
template <typename F>
inline __attribute__((always_inline)) void with_float_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat16: return f(std::integral_constant<DType, DType::kFloat16>{});
    case DType::kBFloat16: return f(std::integral_constant<DType, DType::kBFloat16>{});
    default: return f(std::integral_constant<DType, DType::kFloat32>{});
  }
}

inline __attribute__((always_inline)) void load_as_float(const void* src, DType t, int64_t n, float* dst) {
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
#if defined(QCOLL_HAS_FLOAT16)
      const _Float16* s = static_cast<const _Float16*>(src);  // F16C where the ISA has it
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
#else
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = math::half_bits_to_float(s[i]);
#endif
      return;
    }
    case DType::kBytes: return;  // never reaches a kernel (checked in kernels.cpp / wire.cpp)
  }
}

// Stores computed values (raw copies of the input never come here): NaN is stored as
// CUDA's canonical NaN in every dtype, so CPU and GPU write the same bytes.
inline __attribute__((always_inline)) void store_from_float(const float* src, DType t, int64_t n, void* dst) {
  switch (t) {
    case DType::kFloat32: {
      uint32_t* d = static_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = math::float_to_fp32_bits(src[i]);
      return;
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = math::float_to_bf16_bits(src[i]);
      return;
    }
    case DType::kFloat16: {
#if defined(QCOLL_HAS_FLOAT16)
      // Rounds to nearest even, like CUDA's __float2half_rn; a NaN becomes CUDA's canonical
      // 0x7fff (the hardware conversion keeps the payload), so raw fp16 chunks carry the
      // same bytes on CPU and GPU.
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        const _Float16 h = static_cast<_Float16>(src[i]);
        uint16_t b;
        std::memcpy(&b, &h, 2);
        d[i] = src[i] != src[i] ? uint16_t{0x7fff} : b;
      }
#else
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = math::float_to_half_bits(src[i]);
#endif
      return;
    }
    case DType::kBytes: return;  // never reaches a kernel (checked in kernels.cpp / wire.cpp)
  }
}

}  // namespace cpu
}  // namespace qcoll
