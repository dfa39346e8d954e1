"""The cost probe's kernel timing on a GPU (qcoll._cost_probe._kernel_time): the device's
time per call, not the host's path before a lone launch. Skipped without a GPU."""

from __future__ import annotations

import time

import pytest
import torch

import qcoll
from qcoll import _cost_probe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and qcoll.build_info()["cuda_available"]),
                                 reason="needs a CUDA device and a qcoll build with CUDA kernels")]

N = 1 << 22  # the probe's largest kernel size


def _after_host_work(fn, us=30.0):
    """fn behind `us` microseconds of host work: a lone call's Python path, exaggerated."""
    def call():
        until = time.perf_counter() + us / 1e6
        while time.perf_counter() < until:
            pass
        fn()
    return call


@pytest.mark.parametrize("kernel", ["copy", "quantize int8", "dequantize int8"])
def test_kernel_time_is_the_devices(kernel):
    dev = torch.device("cuda", 0)
    x = torch.randn(N, device=dev)
    if kernel == "copy":
        buf = torch.empty_like(x)
        fn = lambda: buf.copy_(x)  # noqa: E731
    else:
        q = qcoll.quantize(x, bits="int8")
        out = torch.empty_like(x)
        fn = (lambda: qcoll.quantize(x, bits="int8", out=q)) if kernel.startswith("quantize") \
            else (lambda: qcoll.dequantize(q, out=out))  # noqa: E731
    alone = _cost_probe._kernel_time(fn, dev)
    slowed = _cost_probe._kernel_time(_after_host_work(fn), dev)
    on_host = _cost_probe._best_time(_after_host_work(fn), dev)
    # The host's work overlaps the queued kernels: it neither adds to the time nor hides it.
    assert slowed < 1.5 * alone + 2e-6, (alone, slowed)
    assert on_host > 30e-6 and slowed < on_host / 2, (slowed, on_host)
    # And the time is the kernel's: at most the bytes it moves at 10 TB/s (more than any HBM
    # or L2 of today's GPUs gives), nothing like zero.
    moved = x.numel() * x.element_size() * 2 if kernel == "copy" else x.numel() * (x.element_size() + 1)
    assert alone > moved / 10e12, (alone, moved)
