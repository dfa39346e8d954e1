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
    (docs/emulators.md), which proves correctness, not speed. CPU: gloo, the cores
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


def train_loop(name: str, args, rank: int, device, language, step, progress=None, width: int = 8) -> dict:
    """args.steps steps of step(x, y) -> (loss, [bytes sent to other nodes, per phase]) on this
    rank's slice of each global batch. Per step the loss and bytes are averaged over ranks;
    rank 0's progress bar shows them, with a line every args.log_every steps. Returns the
    run's name, losses, final loss (mean of the last 10), median step time (the first step
    left out) and mean bytes per phase."""
    import statistics
    import time

    world = args.ranks
    task = progress.add_task(name, total=args.steps, info="") if progress else None
    losses, times, inter = [], [], []
    for i in range(args.steps):
        x, y = language.batch(i, args.batch * world, args.seq, seed=args.seed)
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, sent = step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        row = torch.tensor([*map(float, sent), loss.item()], dtype=torch.float64, device=device)
        dist.all_reduce(row)
        row = (row / world).tolist()
        losses.append(row[-1])
        inter.append(row[:-1])
        if progress:
            line = f"loss {losses[-1]:.4f}  {1e3 * times[-1]:6.1f} ms  {fmt_bytes(sum(inter[-1]))}/step across nodes"
            progress.update(task, advance=1, info=line)
            if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                progress.console.print(f"{name:{width}s} step {i + 1:4d}  {line}")
    tail = min(10, len(losses))
    later = inter[1:] or inter
    return dict(name=name, final_loss=sum(losses[-tail:]) / tail, losses=losses,
                step_ms=1e3 * statistics.median(times[1:] or times),
                inter=[statistics.mean(v[k] for v in later) for k in range(len(later[0]))])


def run_all(rank: int, header: list, runs: list, report, width: int = 8) -> None:
    """Each of runs (callables taking rank 0's progress bar, None elsewhere, and returning a
    train_loop result) in turn; rank 0 prints the header lines first and report(console,
    results) last. Then the process group is destroyed."""
    console = progress = None
    if rank == 0:
        from rich.console import Console

        console = Console()
        for line in header:
            console.print(line)
        progress = progress_bar(console, width)
        progress.start()
    results = []
    try:
        for run_one in runs:
            results.append(run_one(progress))
    finally:
        if progress:
            progress.stop()
    if rank == 0:
        report(console, results)
    dist.barrier()
    dist.destroy_process_group()


def summary_rows(results: list, phases) -> list:
    """The loss, cross-node bytes (total and per phase) and step-time rows of comparison_table."""
    rows = [("final loss (mean of last 10)", [r["final_loss"] for r in results], lambda v: f"{v:.4f}"),
            ("cross-node bytes / step", [sum(r["inter"]) for r in results], fmt_bytes)]
    rows += [(f"  {p.replace('_', ' ')}", [r["inter"][i] for r in results], fmt_bytes) for i, p in enumerate(phases)]
    rows.append(("step time (median)", [r["step_ms"] for r in results], lambda v: f"{v:.1f} ms"))
    return rows


LOOPBACK_NOTE = ("Step times: local processes on shared CPU cores, loopback links; the bytes are what a "
                 "cluster would carry between nodes.")
