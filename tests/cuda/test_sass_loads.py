"""bench/gpu/sass_loads.py's count of loads in flight, on hand-written SASS."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "sass_loads.py"
spec = importlib.util.spec_from_file_location("sass_loads", SCRIPT)
sass_loads = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loads)


def _kernel(name, body):
    lines = [f".text.{name}:"]
    lines += [f"        /*{16 * i:04x}*/                   {insn} ;" for i, insn in enumerate(body)]
    return "\n".join(lines)


def test_loads_issued_before_any_use_add_up():
    sass = _kernel("batched", [
        "LDG.E.128 R4, desc[UR4][R2.64]",
        "LDG.E.128 R8, desc[UR4][R2.64+0x10]",
        "@P0 LDG.E.64 R12, desc[UR4][R2.64+0x20]",
        "FADD R20, R5, R9",  # first use: 16 + 16 + 8 bytes outstanding
        "STG.E desc[UR4][R2.64], R13",
    ])
    assert sass_loads.analyse(sass) == {"batched": (40, 3)}


def test_load_then_use_keeps_one_packet_in_flight():
    sass = _kernel("serial", [
        "LDG.E.128 R4, desc[UR4][R2.64]",
        "FADD R20, R4, R4",
        "LDG.E.128 R4, desc[UR4][R2.64+0x10]",
        "FADD R21, R7, R20",
        "LDG.E.U8 R9, desc[UR4][R2.64+0x20]",
        "STG.E.U8 desc[UR4][R2.64], R9",  # a store's operands are all sources
    ]) + "\n" + _kernel("overwritten", [
        "LDG.E R4, desc[UR4][R2.64]",
        "MOV R4, R0",  # the load's register reused: never waited for
        "LDG.E R5, desc[UR4][R2.64]",
        "IADD3 R6, R5, R0, RZ",
    ])
    assert sass_loads.analyse(sass) == {"serial": (16, 3), "overwritten": (4, 2)}
