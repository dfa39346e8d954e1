"""The CUDA emulator's recorded results describe today's kernels: the AddressSanitizer run
(bench/results/cuda-emu-asan.txt) and the kernel mutation table (docs/emulators.md) each
carry the stamp of the sources they ran on (sources_stamp.py), which must be that of the
current sources. When this fails, rerun tests/cuda/emu_asan.sh or tests/cuda/mutations.py
(see docs/emulators.md) and commit their new results."""

import re

import pytest

from tests.cuda.sources_stamp import PREFIX, ROOT, sources_stamp

RESULTS = {
    "bench/results/cuda-emu-asan.txt": "tests/cuda/emu_asan.sh",
    "docs/emulators.md": "python tests/cuda/mutations.py",
}


@pytest.mark.parametrize("path", list(RESULTS))
def test_recorded_emulator_results_carry_the_current_sources_stamp(path):
    recorded = re.findall(rf"{PREFIX} [0-9a-f]{{16}}", (ROOT / path).read_text())
    assert len(recorded) == 1, f"{path} must carry one '{PREFIX} ...' stamp, found {recorded}"
    assert recorded[0] == sources_stamp(), (
        f"{path} was recorded on other sources ({recorded[0]}; now {sources_stamp()}): "
        f"rerun `{RESULTS[path]}` and record its result")


def test_stamp_changes_with_any_covered_byte(tmp_path):
    for part in ("src/cuda", "src/testing/emu", "include/qcoll"):
        (tmp_path / part).mkdir(parents=True)
    kernel = tmp_path / "src/cuda/k.cu"
    kernel.write_text("__global__ void k() {}\n")
    (tmp_path / "src/testing/emu/runtime.cpp").write_text("// executor\n")
    (tmp_path / "include/qcoll/quant_math.h").write_text("// math\n")
    (tmp_path / "src/testing/emu/nccl").mkdir()
    before = sources_stamp(tmp_path)
    (tmp_path / "src/testing/emu/nccl/nccl_emu.cpp").write_text("// not the kernel emulator\n")
    assert sources_stamp(tmp_path) == before
    kernel.write_text("__global__ void k() { }\n")
    assert sources_stamp(tmp_path) != before
