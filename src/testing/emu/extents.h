// The global memory each kernel entry point may touch, from its arguments and the
// contracts of qcoll/kernels.h and qcoll/wire.h: the emulator's bounds check allows exactly
// these bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "emu/runtime.h"
#include "qcoll/kernels.h"
#include "qcoll/wire.h"

namespace qcoll {
namespace emu {

inline int64_t esize(DType t) { return static_cast<int64_t>(dtype_size(t)); }

// `count` runs of `bytes` bytes, `stride` apart.
inline size_t runs_extent(int64_t count, int64_t stride, int64_t bytes) {
  return static_cast<size_t>(count > 1 ? (count - 1) * stride + bytes : bytes);
}

inline Buffer buffer(const void* p, size_t bytes, const char* name) {
  return Buffer{reinterpret_cast<uintptr_t>(p), bytes, name};
}

inline std::vector<Buffer> extents(const QuantizeArgs& a) {
  const size_t groups = static_cast<size_t>(num_groups(a.n, a.spec.group_size));
  std::vector<Buffer> b{buffer(a.input, a.n * esize(a.dtype), "input"),
                        buffer(a.codes, code_bytes(a.n, a.spec.format), "codes"),
                        buffer(a.scales, groups * 4, "scales")};
  if (!a.spec.symmetric) b.push_back(buffer(a.offsets, groups * 4, "offsets"));
  return b;
}

inline std::vector<Buffer> extents(const DequantizeArgs& a) {
  const size_t groups = static_cast<size_t>(num_groups(a.n, a.group_size));
  std::vector<Buffer> b{buffer(a.codes, code_bytes(a.n, a.format), "codes"),
                        buffer(a.scales, groups * 4, "scales"),
                        buffer(a.output, a.n * esize(a.dtype), "output")};
  if (!a.symmetric) b.push_back(buffer(a.offsets, groups * 4, "offsets"));
  return b;
}

inline std::vector<Buffer> extents(const EncodeArgs& a) {
  return {buffer(a.input, a.count * a.partition_elems * esize(a.dtype), "input"),
          buffer(a.output, runs_extent(a.count, a.chunk_stride, a.fmt.chunk_bytes(a.len)),
                 "output")};
}

inline std::vector<Buffer> extents(const ReduceArgs& a) {
  const int64_t chunk = a.in_fmt.chunk_bytes(a.len);
  const size_t in = runs_extent(a.sources, a.source_stride, 0) +
                    runs_extent(a.outputs, a.output_in_stride, chunk);
  std::vector<Buffer> b{buffer(a.input, in, "input")};
  if (a.out_wire)
    b.push_back(buffer(a.out_wire,
                       runs_extent(a.outputs, a.out_chunk_stride, a.out_fmt.chunk_bytes(a.len)),
                       "out_wire"));
  else
    b.push_back(buffer(a.out_values,
                       runs_extent(a.outputs, a.out_values_stride * esize(a.out_dtype),
                                   a.len * esize(a.out_dtype)),
                       "out_values"));
  if (a.residual)
    b.push_back(buffer(a.residual, runs_extent(a.outputs, a.residual_stride * 4, a.len * 4),
                       "residual"));
  return b;
}

}  // namespace emu
}  // namespace qcoll
