// CPU kernels' compute rate: ns per element, cache-resident inputs (2^18 elements, or env N),
// best of `reps` calls (argv[1]) on the ISA path argv[2] (baseline, avx2, avx512; default: the
// widest), with an FNV hash of every output so two builds can be compared byte for byte.
// Build: bench/cpu/build_compute_rate.sh SRCDIR OUT (SRCDIR: a tree with include/ and src/).
// Run: OMP_NUM_THREADS=1 OUT [reps] [isa].
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <random>
#include "cpu/cpu_kernels.h"
#include "cpu/isa.h"
#include "qcoll/quant_math.h"
using namespace qcoll;
static uint32_t fnv(const void* p, size_t n, uint32_t h = 2166136261u) {
  const uint8_t* b = (const uint8_t*)p; for (size_t i = 0; i < n; ++i) { h ^= b[i]; h *= 16777619u; } return h; }
template <class F> double best_ns(F f, int reps) {
  double best = 1e30; for (int r = 0; r < reps; ++r) { auto t0 = std::chrono::steady_clock::now(); f();
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count(); if (ns < best) best = ns; }
  return best; }
int main(int argc, char** argv) {
  const int64_t n = getenv("N") ? atoll(getenv("N")) : (1 << 18); const int reps = argc > 1 ? atoi(argv[1]) : 30;
  if (argc > 2) { cpu::Isa isa; cpu::parse_isa(argv[2], &isa); cpu::set_isa(isa); }
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  std::vector<float> x(n); for (auto& v : x) v = nd(rng);
  std::vector<uint16_t> xb(n); for (int64_t i = 0; i < n; ++i) xb[i] = math::float_to_bf16_bits(x[i]);
  std::vector<uint8_t> codes(n * 2); std::vector<float> scales(n), offs(n); std::vector<float> out(n);
  const char* fmts[] = {"int8", "int4", "fp8"}; CodeFormat cf[] = {CodeFormat::kInt8, CodeFormat::kInt4, CodeFormat::kFp8E4M3};
  struct Case { int f; int bf; int had; int sr; };
  std::vector<Case> cases = {{0,0,0,0},{1,0,0,0},{2,0,0,0},{0,1,0,0},{1,1,0,0},{2,1,0,0},{0,0,256,0},{1,0,256,0},{1,1,256,0},{2,0,256,0},{0,0,0,1},{0,1,0,1},{2,0,0,1}};
  for (auto c : cases) {
    QuantizeArgs a; a.input = c.bf ? (void*)xb.data() : (void*)x.data(); a.dtype = c.bf ? DType::kBFloat16 : DType::kFloat32; a.n = n;
    a.spec.format = cf[c.f]; a.spec.group_size = 256; a.spec.symmetric = true; a.spec.hadamard_size = c.had;
    a.spec.rounding = c.sr ? Rounding::kStochastic : Rounding::kNearest; a.spec.seed = 7;
    a.codes = codes.data(); a.scales = scales.data(); a.offsets = offs.data();
    double ns = best_ns([&] { cpu::quantize(a); }, reps);
    uint32_t h = fnv(codes.data(), code_bytes(n, a.spec.format)); h = fnv(scales.data(), 4 * (n / 256), h);
    DequantizeArgs d; d.codes = codes.data(); d.scales = scales.data(); d.n = n; d.format = a.spec.format; d.group_size = 256;
    d.hadamard_size = c.had; d.output = out.data(); d.dtype = a.dtype;
    double nsd = c.sr ? 0 : best_ns([&] { cpu::dequantize(d); }, reps);
    uint32_t hd = fnv(out.data(), n * (c.bf ? 2 : 4));
    printf("q   %-4s %s had=%3d sr=%d: %.3f ns/elem hash=%08x | dq %.3f ns/elem hash=%08x\n", fmts[c.f], c.bf ? "bf16" : "fp32", c.had, c.sr, ns / n, h, nsd / n, hd);
  }
  // swizzled encode int8
  for (int bf = 0; bf < 2; ++bf) {
    EncodeArgs e; e.input = bf ? (void*)xb.data() : (void*)x.data(); e.dtype = bf ? DType::kBFloat16 : DType::kFloat32;
    e.count = 4; e.partition_elems = n / 4; e.slice_begin = 0; e.len = n / 4; e.node_size = 2; e.nodes = 2;
    e.fmt.format = CodeFormat::kInt8; e.fmt.group_size = 256; int64_t cb = e.fmt.chunk_bytes(e.len); e.chunk_stride = cb;
    std::vector<uint8_t> w(4 * cb); e.output = w.data();
    double ns = best_ns([&] { cpu::encode_chunks(e); }, reps);
    printf("swz int8 %s: %.3f ns/elem hash=%08x\n", bf ? "bf16" : "fp32", ns / n, fnv(w.data(), w.size()));
  }
  // reduce: K int8 chunks of n/4... use m elements each
  for (int K : {2, 4}) {
    int64_t m = n / 4; WireFormat in; in.format = CodeFormat::kInt8; int64_t cb = in.chunk_bytes(m);
    std::vector<uint8_t> src(K * cb);
    EncodeArgs e; e.input = x.data(); e.dtype = DType::kFloat32; e.count = K; e.partition_elems = m; e.len = m; e.fmt = in; e.output = src.data(); e.chunk_stride = cb; cpu::encode_chunks(e);
    ReduceArgs r; r.input = src.data(); r.in_fmt = in; r.len = m; r.sources = K; r.source_stride = cb; r.outputs = 1; r.output_in_stride = 0;
    WireFormat of; of.format = CodeFormat::kInt4; int64_t ob = of.chunk_bytes(m); std::vector<uint8_t> o(ob);
    r.out_wire = o.data(); r.out_fmt = of; r.out_chunk_stride = ob;
    double ns = best_ns([&] { cpu::reduce_chunks(r); }, reps);
    printf("dqrq int8x%d->int4: %.3f ns/out-elem hash=%08x\n", K, ns / m, fnv(o.data(), ob));
  }
  for (int bf = 0; bf < 2; ++bf) {
    int64_t m = n / 2; WireFormat in; in.format = CodeFormat::kInt4; int64_t cb = in.chunk_bytes(m); int K = 2;
    std::vector<uint8_t> src(K * cb);
    EncodeArgs e; e.input = x.data(); e.dtype = DType::kFloat32; e.count = K; e.partition_elems = m; e.len = m; e.fmt = in; e.output = src.data(); e.chunk_stride = cb; cpu::encode_chunks(e);
    ReduceArgs r; r.input = src.data(); r.in_fmt = in; r.len = m; r.sources = K; r.source_stride = cb; r.divisor = 2.0f;
    r.out_values = out.data(); r.out_dtype = bf ? DType::kBFloat16 : DType::kFloat32; r.out_values_stride = m;
    double ns = best_ns([&] { cpu::reduce_chunks(r); }, reps);
    printf("dqr int4x2->%s: %.3f ns/out-elem hash=%08x\n", bf ? "bf16" : "fp32", ns / m, fnv(out.data(), m * (bf ? 2 : 4)));
  }
}
