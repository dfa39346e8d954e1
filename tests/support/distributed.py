"""Run a function on several gloo ranks spawned from a test.

Workers come from a forkserver that has imported torch and qcoll once, so a spawn costs
a fraction of a second; each run gets its own FileStore, and a hung run is killed and
reported instead of stalling the suite."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback

_CTX = mp.get_context("forkserver")
# pytest too: workers are functions of test modules, which import it (~0.25 s a process).
_CTX.set_forkserver_preload(["torch", "torch.distributed", "qcoll", "pytest"])


def _worker(fn, rank, world, store_path, env, args, results, teardown=True):
    import torch
    import torch.distributed as dist

    os.environ.update(env.get(rank, {}))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        if teardown:  # not where a rank died on purpose: a barrier would wait for it
            dist.barrier()
            dist.destroy_process_group()
        # Plain pickle copies tensor data: the queue's own pickler would pass tensors as
        # shared-memory handles, which die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn, *args, env=None, timeout: float = 120.0, dead=()) -> list:
    """fn(rank, world, *args) on `world` gloo ranks; returns the per-rank results.

    env: optional {rank: {VAR: value}} set in that rank before init. A failing rank's
    traceback is raised as AssertionError in the test; a hang past `timeout` fails too.
    dead: ranks that exit on purpose (os._exit) without a result (None in the list); the
    others then skip the final barrier, and one still running once they have all reported (a
    rank that stalls on purpose) is killed then.
    """
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        results = _CTX.Queue()
        procs = [_CTX.Process(target=_worker, args=(fn, r, world, store, env or {}, args, results,
                                                     not dead))
                 for r in range(world)]
        for p in procs:
            p.start()
        collected = {}
        try:
            for _ in range(world - len(dead)):
                rank, status, payload = results.get(timeout=timeout)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                collected[rank] = pickle.loads(payload)
        except queue.Empty:
            missing = sorted(set(range(world)) - set(collected) - set(dead))
            raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang?)") from None
        finally:
            deadline = time.monotonic() + 10  # for all of them, not 10 s each
            reported = set(collected) == set(range(world)) - set(dead)
            for r, p in enumerate(procs):
                if reported and r in dead and p.is_alive():
                    # Nothing more to come from it once the others reported: a rank that stalls
                    # on purpose sleeps past their timeouts (13 s of each such test, unkilled).
                    p.kill()
                p.join(timeout=max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
        return [collected.get(r) for r in range(world)]
