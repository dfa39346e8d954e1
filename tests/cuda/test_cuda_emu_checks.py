"""The emulator itself: warp shuffles and barriers compute what CUDA defines, and every check
fires on a kernel that breaks its rule, naming the kernel, block and thread
(src/testing/emu/selftest_kernels.cpp), under both schedules."""

import pytest
import torch

from tests.support.cuda_emu import EMU, EmuBackend

pytestmark = pytest.mark.cuda_emu


@pytest.fixture(params=["ordered", "random"])
def schedule(request):
    EmuBackend(request.param, seed=3)
    return request.param


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("lane_mask", [1, 2, 5, 16, 31])
def test_shuffle_xor_reads_the_partner_lane(schedule, lane_mask, width):
    out = EMU.selftest("shuffle_xor", lane_mask, width)
    for block in range(2):
        for t in range(64):
            lane = t % 32
            src = lane ^ lane_mask
            # A partner past the end of the lane's segment of `width` lanes: own value.
            partner = t - lane + src if src < (lane // width + 1) * width else t
            assert out[block * 64 + t] == 1000 * block + partner, (block, t)


def test_block_sum_through_shared_memory_and_barriers(schedule):
    out = EMU.selftest("block_sum")
    assert out == [256 * 257 // 2] * 768


# Checks on each memory access (src/testing/emu/access_hooks.cpp).
ACCESS_CHECKS = {"shared_race", "shared_uninitialized", "misaligned_vector", "global_race",
                 "out_of_bounds", "global_read_then_write"}


@pytest.mark.parametrize("name,message", [
    ("barrier_skipped", r"divergent __syncthreads: thread \d+ waits at selftest_kernels.cpp:\d+ "
                        r"but thread 5 exited without reaching it \(kernel barrier_skipped, "
                        r"block \(0,0,0\)\)"),
    ("barrier_two_sites", r"divergent __syncthreads: thread \d+ waits at selftest_kernels.cpp:\d+,"
                          r" thread \d+ at selftest_kernels.cpp:\d+"),
    ("shuffle_masks_disagree", r"with mask 0x[0-9a-f]+ meets lane \d+'s collective at "
                               r"selftest_kernels.cpp:\d+ with mask 0x[0-9a-f]+ \(masks must agree"),
    ("shuffle_exited_lane", r"lane 31 (exited|.*which has exited)"),
    ("shuffle_reads_outside_mask", r"lane \d+ reads lane \d+, which mask 0xffff does not name"),
    ("shared_race", r"(shared-memory race: .* thread 0|which no thread of the block has written)"),
    ("shared_uninitialized", r"read of shared byte 0x[0-9a-f]+, which no thread of the block has "
                             r"written \(kernel shared_uninitialized, block \(0,0,0\), thread "
                             r"(3[2-9]|[4-6]\d)\)"),
    ("misaligned_vector", r"misaligned 16-byte load at 0x[0-9a-f]*4 \(the device requires 16-byte"
                          r" alignment\) \(kernel misaligned_vector, block \(0,0,0\), thread \d\)"),
    ("global_race", r"global-memory race: (read|write) of byte \d+ of buffer 'out', (written|read) "
                    r"by thread 0 of block [01] in this launch \(kernel global_race, block"),
    ("global_read_then_write", r"global-memory race: (write|read) of byte \d+ of buffer 'out', "
                               r"(read|written) by thread \d+ of block 0 in this launch \(kernel "
                               r"global_read_then_write, block \(0,0,0\), thread \d+\)"),
    ("out_of_bounds", r"out-of-bounds global store of 4 bytes at 0x[0-9a-f]+; buffers: out=\[0x"
                      r"[0-9a-f]+, \+128\) \(kernel out_of_bounds, block \(0,0,0\), thread 31\)"),
])
def test_each_check_fires(schedule, name, message):
    if name in ACCESS_CHECKS and not EMU.ACCESS_CHECKS:
        pytest.skip("the AddressSanitizer build checks accesses with ASan (tests/cuda/emu_asan.sh)")
    with pytest.raises(EMU.EmuError, match=message):
        EMU.selftest(name)
    EMU.selftest("block_sum")  # the emulator is usable after an error


@pytest.mark.skipif(not EMU.ACCESS_CHECKS, reason="access checks are ASan's in this build")
def test_shared_race_names_both_threads_in_thread_order():
    EmuBackend("ordered")
    with pytest.raises(EMU.EmuError, match=r"shared-memory race: read of shared byte 0x[0-9a-f]+ "
                       r"written by thread 0 since the last __syncthreads \(kernel shared_race, "
                       r"block \(0,0,0\), thread 1\)"):
        EMU.selftest("shared_race")


@pytest.mark.skipif(not EMU.ACCESS_CHECKS, reason="access checks are ASan's in this build")
def test_global_read_then_another_threads_write_is_a_race():
    # Ordered: thread 0 reads element 1 before thread 1 writes it, and no thread reads a
    # byte already written, so only the record of global reads can see this race.
    EmuBackend("ordered")
    with pytest.raises(EMU.EmuError, match=r"global-memory race: write of byte 4 of buffer 'out', "
                       r"read by thread 0 of block 0 in this launch \(kernel "
                       r"global_read_then_write, block \(0,0,0\), thread 1\)"):
        EMU.selftest("global_read_then_write")


def test_entry_points_validate_like_qcoll():
    x = torch.zeros(16)
    out = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="format must be int8 \\(0\\), int4 \\(1\\) or fp8_e4m3"):
        EMU.quantize(x.data_ptr(), 0, 16, 5, 8, True, 0, 0, 0, out.data_ptr(), out.data_ptr(), 0,
                     EMU.DEVICE_KIND, 0, 0)
    with pytest.raises(ValueError, match="schedule must be 'ordered' or 'random'"):
        EMU.configure("fastest")


@pytest.mark.skipif(not EMU.ACCESS_CHECKS, reason="written bytes are tracked by the access hooks")
def test_grid_sample_runs_first_last_and_seeded_blocks():
    be = EmuBackend("ordered", seed=1, max_blocks=6)
    n = 256 * 8 * 40  # dequantize: 40 blocks of 256 packets
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
    scales = torch.ones(n // 256)
    y = be.dequantize(codes, scales, None, n, 8, 256, torch.float32)
    (_, grid, _, run, _), = EMU.last_call()["launches"]
    assert (grid, run) == (40, 6)
    ranges = be.written(y)
    block = 256 * 8 * 4  # output bytes of one block
    assert sum(hi - lo for lo, hi in ranges) == 6 * block
    for b in (0, 1, 38, 39):
        assert any(lo <= b * block and (b + 1) * block <= hi for lo, hi in ranges), b
    for lo, hi in ranges:  # codes are two's complement bytes, scale 1
        want = codes[lo // 4 : hi // 4].view(torch.int8).float()
        assert torch.equal(y[lo // 4 : hi // 4], want)
