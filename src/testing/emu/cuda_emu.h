// The CUDA surface that src/cuda uses, for the host compiler, and only that: qualifiers,
// the built-in index variables, __syncthreads, __shfl_xor_sync, atomicMax, bit casts and
// rounding intrinsics, vector types, and the few runtime calls of the launchers. Semantics
// are what the CUDA C++ Programming Guide guarantees; the executor is runtime.h.
//
// Included (through the shims in src/testing/emu/shim) by the kernel sources compiled for the
// emulator, src/testing/emu/kernels_*.cpp, which define __CUDA_ARCH__ so that every shared
// host/device helper (qcoll/quant_math.h) takes its device branch, as nvcc's device pass does.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emu/runtime.h"

#if !defined(__CUDA_ARCH__)
#error "emulated kernels are compiled through src/testing/emu/kernels_*.cpp (device branch selected)"
#endif
// __fadd_rn & co. below are plain float operations: they are the IEEE single-precision
// operations only with SSE-style arithmetic (no x87 excess precision) and no FMA
// contraction (the build passes -ffp-contract=off).
#if FLT_EVAL_METHOD != 0
#error "the CUDA emulator needs IEEE single-precision float arithmetic (FLT_EVAL_METHOD 0)"
#endif

#define QCOLL_CUDA_EMU 1

// ---- qualifiers ------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// A function-local static: one block runs at a time, so the block's threads share it. The
// executor tells it from global memory by address (the module's data segment) and tracks
// every byte's accesses between barriers; contents do not survive to the next block
// (reading a byte not written in the block is an error).
#define __shared__ static

// ---- built-in variables ------------------------------------------------------------------------
#define threadIdx (::qcoll::emu::thread_idx())
#define blockIdx (::qcoll::emu::block_idx())
#define blockDim (::qcoll::emu::block_dim())
#define gridDim (::qcoll::emu::grid_dim())

// ---- synchronization -----------------------------------------------------------------------------
// The call site (file:line) names the barrier in error messages and must be the same for
// every thread of the block.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::qcoll::emu::sync_threads(file, line);
}

// Every lane named in `mask` must call the same __shfl_xor_sync with the same mask; the
// result is `var` of lane (lane ^ lane_mask) within the lane's `width` segment.
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_arithmetic_v<T> && (sizeof(T) == 4 || sizeof(T) == 8),
                "__shfl_xor_sync takes 32- or 64-bit arithmetic values");
  uint64_t bits = 0;
  __builtin_memcpy(&bits, &var, sizeof(T));
  bits = ::qcoll::emu::shfl_xor(mask, bits, lane_mask, width, file, line);
  T out;
  __builtin_memcpy(&out, &bits, sizeof(T));
  return out;
}

inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
  return ::qcoll::emu::atomic_max_u32(address, value);
}

// ---- bit casts and IEEE round-to-nearest arithmetic ------------------------------------------
inline float __uint_as_float(unsigned int u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) { return __uint_as_float(static_cast<unsigned int>(i)); }
inline int __float_as_int(float f) { return static_cast<int>(__float_as_uint(f)); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE-correct, as on the device
// rintf and floorf are <cmath>'s: in the default rounding mode rintf rounds half to even.

// ---- vector types ----------------------------------------------------------------------------
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return {x, y, z, w};
}
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ---- the runtime calls the launchers make ---------------------------------------------------
#if defined(QCOLL_EMU_STREAMS)
// The virtual-GPU build: the emulated CUDA runtime (src/testing/emu/cudart), kernels on its streams.
#include "emu/cudart/cuda_runtime_api.h"
#include "emu/stream_launch.h"
#else
typedef struct CUstream_st* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidDevice = 101 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }  // launch errors throw instead
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorInvalidDevice";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "invalid device ordinal (the emulator has device 0)";
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  ::qcoll::emu::host_memset(p, value, bytes);
  return cudaSuccess;
}

#endif  // QCOLL_EMU_STREAMS

// ---- fp16 / bf16: the device's conversions round to nearest even and return the canonical
// NaN 0x7fff; qcoll/quant_math.h has exactly these for the host, so they are shared. -------
#include "qcoll/quant_math.h"

struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { return ::qcoll::math::half_bits_to_float(h.x); }
inline __half __float2half_rn(float f) { return {::qcoll::math::float_to_half_bits(f)}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline float __bfloat162float(__nv_bfloat16 b) { return ::qcoll::math::bf16_bits_to_float(b.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return {::qcoll::math::float_to_bf16_bits(f)};
}
