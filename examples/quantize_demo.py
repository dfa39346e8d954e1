"""qcoll's main job at this stage: block-quantize a tensor, report the error against the
guaranteed bound and the kernels' throughput next to this machine's copy bandwidth.

    python examples/quantize_demo.py [--numel N] [--device cpu|cuda]
"""

import argparse
import time

import torch

import qcoll


def seconds(fn, device, repeats=10):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--device", default="cuda" if qcoll.build_info()["cuda_available"] else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    info = qcoll.build_info()
    print(f"qcoll {info['version']}: CUDA kernels {'on' if info['cuda'] else 'off'} "
          f"(archs {info['cuda_archs']}), GPU available: {info['cuda_available']}, "
          f"OpenMP threads: {info['openmp_threads']}")
    x = torch.randn(args.numel, device=device)
    copy_dst = torch.empty_like(x)
    copy_gbps = 2 * x.numel() * 4 / seconds(lambda: copy_dst.copy_(x), device) / 1e9
    print(f"{args.numel} fp32 elements on {device}; copy bandwidth {copy_gbps:.1f} GB/s\n")
    print(f"{'dtype':9}{'format':>9}{'mode':>11}{'max |err|/scale':>17}{'rel RMS err':>13}"
          f"{'quant GB/s':>12}{'dequant GB/s':>14}")
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for bits in ("int8", "int4", "fp8_e4m3"):
            for symmetric in (True, False) if bits != "fp8_e4m3" else (True,):
                q = qcoll.quantize(xd, bits=bits, symmetric=symmetric)
                y = qcoll.dequantize(q, dtype=torch.float32)
                scale = q.scales.repeat_interleave(q.group_size)[: x.numel()]
                err = (y - xd.float()).abs()
                worst = (err / scale.clamp_min(1e-30)).max().item()
                rel = (err.pow(2).mean().sqrt() / xd.float().pow(2).mean().sqrt()).item()
                moved = xd.numel() * xd.element_size() + q.nbytes
                tq = seconds(lambda: qcoll.quantize(xd, bits=bits, symmetric=symmetric, out=q), device)
                out = torch.empty_like(xd)
                tdq = seconds(lambda: qcoll.dequantize(q, out=out), device)
                mode = "symmetric" if symmetric else "asymmetric"
                print(f"{str(dtype)[6:]:9}{bits:>9}{mode:>11}{worst:17.4f}{rel:13.2e}"
                      f"{moved / tq / 1e9:12.1f}{moved / tdq / 1e9:14.1f}")
    print("\nmax |err|/scale <= 0.5 is the guarantee of int8/int4 (fp32 output); fp8_e4m3's is"
          "\n|err| <= |x| / 16 + scale / 1024: at most 16 scales, half the step between its"
          "\nlargest codes (256 to 448 in steps of 32).")


if __name__ == "__main__":
    main()
