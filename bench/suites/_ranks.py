"""Start the ranks of a collectives benchmark as separate processes and collect rank 0's
result: locally, or each inside its node's network namespace (the cluster suite)."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


class RanksFailed(RuntimeError):
    pass


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def launch(config: dict, *, prefix: Optional[Callable[[int], list]] = None,
           env: Optional[Callable[[int], dict]] = None, progress=None, task=None,
           timeout: float = 600.0, worker: str = WORKER) -> dict:
    """Run worker (default _worker.py) on config["world"] ranks; returns rank 0's result.

    prefix(rank): argv put before the interpreter (e.g. ["ip", "netns", "exec", NS]).
    env(rank): extra environment of that rank. progress/task: a rich Progress advanced by
    rank 0's PROGRESS lines. Every rank is killed if one fails or the run outlasts timeout.
    """
    world = config["world"]
    with tempfile.TemporaryDirectory(prefix="qcoll-bench-") as tmp:
        cfg = dict(config, store=os.path.join(tmp, "store"), out=os.path.join(tmp, "out.json"),
                   timeout_s=int(timeout))
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        procs, logs = [], []
        base_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        try:
            for r in range(world):
                log = os.path.join(tmp, f"rank{r}.log")
                logs.append(log)
                argv = (prefix(r) if prefix else []) + [sys.executable, worker, cfg_path, str(r)]
                with open(log, "w") as err:
                    procs.append(subprocess.Popen(
                        argv, env=dict(base_env, **(env(r) if env else {})), stderr=err,
                        stdout=subprocess.PIPE if r == 0 else err, text=True))
            _follow(procs, logs, progress, task, time.monotonic() + timeout)
            with open(cfg["out"]) as f:
                return json.load(f)
        finally:
            for p in procs:  # only the processes started above, by their handles
                if p.poll() is None:
                    p.kill()
                    p.wait()
                if p.stdout:
                    p.stdout.close()


def _follow(procs, logs, progress, task, deadline: float) -> None:
    """Read rank 0's progress until every rank exits; raise on a failure or the deadline."""
    sel = selectors.DefaultSelector()
    sel.register(procs[0].stdout, selectors.EVENT_READ)
    open_stream = True
    while True:
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            r = failed[0]
            raise RanksFailed(f"rank {r} exited with {procs[r].returncode}:\n{_tail(logs[r])}")
        if not open_stream and all(p.poll() == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            stuck = [r for r, p in enumerate(procs) if p.poll() is None]
            raise RanksFailed(f"ranks {stuck} still running at the deadline (hang?); rank "
                              f"{stuck[0]}'s log:\n{_tail(logs[stuck[0]])}")
        if open_stream:
            for _ in sel.select(timeout=0.2):
                line = procs[0].stdout.readline()
                if not line:
                    sel.unregister(procs[0].stdout)
                    open_stream = False
                elif line.startswith("PROGRESS") and progress is not None:
                    done, total = map(int, line.split()[1:3])
                    progress.update(task, completed=done, total=total)
        else:
            time.sleep(0.05)
