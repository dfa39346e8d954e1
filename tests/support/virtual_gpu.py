"""Ranks under the virtual GPU (QCOLL_VIRTUAL_GPU=1, python/qcoll/_vgpu.py): qcoll's CUDA
branch on CPU tensors, over its NCCL driver and the NCCL stand-in, one process per rank.

The switch is read when qcoll is imported, so the ranks are fresh interpreters (not the
forkserver of distributed.py, which has qcoll imported already). Each runs one function of
vgpu_scenarios.py after joining a gloo world (qcoll's NCCL setup exchanges its unique id
over it). A hung run is killed and reported with every rank's output.

Also the worker: python tests/support/virtual_gpu.py SCENARIO RANK WORLD STORE OUT ARGS_PICKLE."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository: tests.support imports from it


def run_virtual(world: int, scenario: str, *args, env=None, timeout: float = 120.0,
                dead=()) -> list:
    """vgpu_scenarios.<scenario>(rank, world, *args) on `world` ranks; the per-rank results.
    Every other rank must write its result and exit with 0.
    env: {rank: {VAR: value}}. dead: ranks that exit on purpose (their result is None and
    the others skip the final barrier)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        argfile = os.path.join(tmp, "args.pkl")
        with open(argfile, "wb") as f:
            pickle.dump((args, bool(dead)), f)
        procs = []
        for r in range(world):
            e = dict(os.environ, QCOLL_VIRTUAL_GPU="1", OMP_NUM_THREADS="1",
                     PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), ROOT]).strip(os.pathsep))
            e.update((env or {}).get(r, {}))
            log = open(os.path.join(tmp, f"log{r}"), "w+")
            procs.append((subprocess.Popen(
                [sys.executable, os.path.join(HERE, "virtual_gpu.py"), scenario, str(r),
                 str(world), store, tmp, argfile], env=e, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        hung = False
        for p, _ in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
        if hung:
            for p, _ in procs:
                p.kill()
                p.wait()
        logs = []
        for r, (p, log) in enumerate(procs):
            log.seek(0)
            logs.append(f"--- rank {r} (exit {p.returncode}):\n{log.read()[-6000:]}")
            log.close()
        if hung:
            raise AssertionError(f"virtual-GPU run {scenario} hung past {timeout} s\n" + "\n".join(logs))
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"result{r}.pkl")
            if r in dead:
                assert not os.path.exists(path), f"rank {r} was meant to die\n" + logs[r]
                results.append(None)
                continue
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} of {scenario} failed\n" + "\n".join(logs))
            # A rank that crashed after writing its result (at exit, say) has failed too.
            if procs[r][0].returncode != 0:
                raise AssertionError(f"rank {r} of {scenario} exited with {procs[r][0].returncode}"
                                     " after its result\n" + "\n".join(logs))
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def _worker(scenario: str, rank: int, world: int, store: str, out: str, argfile: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(argfile, "rb") as f:
        args, has_dead = pickle.load(f)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from tests.support import vgpu_scenarios

    result = getattr(vgpu_scenarios, scenario)(rank, world, *args)
    if not has_dead:  # a barrier would wait for a rank that died on purpose
        dist.barrier()
        dist.destroy_process_group()
    tmp = os.path.join(out, f"result{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(out, f"result{rank}.pkl"))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
