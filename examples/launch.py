"""What the training examples (train_zero3.py, train_fsdp2.py) share: starting ranks (spawned
here, or one process per rank under torchrun), a rank's device and process group, rank 0's
progress bar and the side-by-side table of two runs."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launched() -> bool:
    """True when a launcher (torchrun) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(worker, args) -> None:
    """worker(rank, args, store) on every rank: this process under torchrun (store None:
    the launcher's env:// rendezvous), else args.ranks spawned processes on a FileStore."""
    if launched():
        worker(int(os.environ["RANK"]), args, None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.ranks, join=True)


def setup(rank: int, ranks: int, backend: str, store) -> torch.device:
    """The rank's device and the default process group. GPUs: one per rank; several ranks
    sharing one GPU each get their own NCCL host id and talk over loopback sockets
    (../shared/gpu/README.md), which proves correctness, not speed. CPU: gloo, the cores
    split between the ranks."""
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if ranks > gpus:
            os.environ.update(NCCL_HOSTID=f"qhost{rank}", NCCL_NET="Socket", NCCL_SOCKET_IFNAME="lo",
                              NCCL_MNNVL_ENABLE="0", NCCL_PAT_ENABLE="0")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    rendezvous = {} if store is None else dict(init_method=f"file://{store}", rank=rank, world_size=ranks)
    dist.init_process_group(backend, **rendezvous, **({"device_id": device} if device.type == "cuda" else {}))
    return device


def progress_bar(console, width: int = 8):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(f"{{task.description:{width}s}}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console, transient=True)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def comparison_table(title: str, results: list, rows: list):
    """A rich Table: a column per result (its "name"), a ratio column when there are two;
    rows: (label, [value per result], format) or None to skip."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    for r in results:
        table.add_column(r["name"], justify="right")
    if len(results) == 2:
        table.add_column("ratio", justify="right")
    for label, values, fmt in rows:
        cells = [fmt(v) for v in values]
        if len(values) == 2:
            cells.append(f"{values[1] / values[0]:.3f}" if values[0] else "-")
        table.add_row(label, *cells)
    return table
