"""The CUDA emulator module (qcoll._cuda_emu, src/testing/emu) as a cuda_cases.Backend.

QCOLL_EMU_MODULE=/path/to/_cuda_emu*.so loads another build of it (tests/cuda/mutations.py and
tests/cuda/emu_asan.sh use this for mutated and AddressSanitizer builds)."""

from __future__ import annotations

import importlib.util
import os

import torch

import qcoll.quantization

from tests.support import cuda_cases as cases
from tests.support import reference as ref
from tests.quantize.test_wire import CODE, GARBAGE, wire_code


def load_emu():
    path = os.environ.get("QCOLL_EMU_MODULE")
    if not path:
        from qcoll import _cuda_emu

        return _cuda_emu
    spec = importlib.util.spec_from_file_location("_cuda_emu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EMU = load_emu()
ROUNDING = {"nearest": 0, "stochastic": 1}
# Blocks a capped launch runs (EmuBackend's grid_cap): small, so every kernel's grid-stride
# loop wraps at the test cases' sizes; more than one, so blocks still share the work.
GRID_CAP = 3


def garbage(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.full((nbytes,), GARBAGE, dtype=torch.uint8).view(dtype)


class EmuBackend(cases.Backend):
    """The CUDA kernels run by the emulator on CPU memory. Every buffer is its own host
    allocation of exactly the bytes the kernel may touch (so an AddressSanitizer build
    catches any overrun). max_blocks > 0 runs a sample of the blocks of larger grids and
    compares only the bytes they wrote; grid_cap > 0 runs larger grids as that many blocks,
    which loop over the rest."""

    lib = EMU

    def __init__(self, schedule: str = "ordered", seed: int = 0, max_blocks: int = 0,
                 grid_cap: int = 0):
        self.max_blocks = max_blocks
        EMU.configure(schedule, seed, max_blocks, track_writes=max_blocks > 0, grid_cap=grid_cap)
        self.writes = []

    def place(self, t, shift_bytes=0):
        nbytes = t.numel() * t.element_size()
        if (shift_bytes == 0 and t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == nbytes):
            return t.reshape(-1)  # already an exact allocation: no copy of large inputs
        buf = torch.empty(shift_bytes + nbytes, dtype=torch.uint8)
        view = buf[shift_bytes:].view(t.dtype)
        view.copy_(t.reshape(-1))
        return view

    def device_args(self):
        return (EMU.DEVICE_KIND, 0, 0)

    def output(self, nbytes, dtype=torch.uint8):
        # Unsampled runs start from garbage, so a byte left unwritten is caught.
        if self.max_blocks:
            return torch.empty(nbytes, dtype=torch.uint8).view(dtype)
        return garbage(nbytes, dtype)

    def quantize(self, x, *, bits=8, group_size=None, symmetric=True, rounding="nearest",
                 seed=None, hadamard=False, hadamard_size=None):
        gs, n = group_size or 256, x.numel()
        hs = qcoll.quantization.check_hadamard(hadamard, hadamard_size, gs)
        groups = -(-n // gs)
        codes = self.output(-(-n * ref.width(bits) // 8))
        scales = self.output(4 * groups, torch.float32)
        offsets = None if symmetric else self.output(4 * groups, torch.float32)
        self.lib.quantize(x.data_ptr(), CODE[x.dtype], n, wire_code(bits), gs, symmetric, ROUNDING[rounding],
                     seed or 0, 0, codes.data_ptr(), scales.data_ptr(),
                     0 if offsets is None else offsets.data_ptr(), *self.device_args(),
                     hadamard_size=hs)
        self.writes = EMU.last_call()["writes"]
        return codes, scales, offsets

    def dequantize(self, codes, scales, offsets, n, bits, group_size, dtype, hadamard_size=0):
        out = self.output(n * torch.finfo(dtype).bits // 8, dtype)
        self.lib.dequantize(codes.data_ptr(), scales.data_ptr(),
                       0 if offsets is None else offsets.data_ptr(), n, wire_code(bits), group_size,
                       offsets is None, out.data_ptr(), CODE[dtype], *self.device_args(),
                       hadamard_size=hadamard_size)
        self.writes = EMU.last_call()["writes"]
        return out

    def written(self, t):
        if not self.max_blocks:
            return None
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return [(max(a, lo) - lo, min(a + n, hi) - lo) for a, n in self.writes
                if a < hi and a + n > lo]
