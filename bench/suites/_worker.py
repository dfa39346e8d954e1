"""One rank of the collectives benchmark (started by _ranks.launch, never by hand).

    python bench/suites/_worker.py CONFIG.json RANK

For every size and collective (all-reduce, reduce-scatter, all-gather) it times
torch.distributed's own call, the same baseline
through qcoll (bits=None, hierarchical=False: the transport's collective, with qcoll's byte
accounting), and qcoll's quantized call, one after the other in this process, on the same
ranks and inputs. Rank 0 prints `PROGRESS done total` lines and writes the rows as JSON to
the config's "out" path."""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import statistics
import sys
import time
import zlib

import torch
import torch.distributed as dist

import qcoll
from qcoll import _C
from qcoll._dtypes import DTYPE_CODES as CODES
from qcoll._formats import format_code

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for timing
from timing import _busy_seconds, _own_seconds, balanced_sequence  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch's all_gather_into_tensor / reduce_scatter_tensor; torch >= 2.9 names them
# all_gather_single / reduce_scatter_single and deprecates the old names (same collective).
TORCH_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
TORCH_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
MAX_OTHER_CORES = 0.5  # CPU used by other processes during a measurement: above, retry


def _values(seed: tuple, n: int, dtype, device) -> torch.Tensor:
    """Gaussian values of one (rank, partition, size): any rank can regenerate any rank's."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randn(n, generator=g).to(dtype).to(device)


def _tx_bytes(iface) -> int:
    if not iface:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


class Bench:
    def __init__(self, cfg: dict, rank: int):
        self.cfg, self.rank, self.world = cfg, rank, cfg["world"]
        self.device = torch.device(cfg["device"])
        # The node's one bound interface carries exactly its cross-node traffic (ranks of a
        # node reach each other over loopback); its first rank reads the counter.
        self.iface = cfg.get("iface") if rank % cfg["node_size"] == 0 else None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def allsum(self, values, op=dist.ReduceOp.SUM) -> list:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def time(self, fn) -> dict:
        return self.time_interleaved({"fn": fn})["fn"]

    def time_interleaved(self, fns: dict, calls_per_turn: int = 1, rotate: bool = False,
                         min_seconds: float = 0.0) -> dict:
        """For each fn: the median over repeats of the slowest rank's time, the node's egress
        bytes and this rank's page faults per call. The fns take turns (a, b, c, a, b, c,
        ...; rotate: the turns follow timing.balanced_sequence, whole cycles of it, so each
        fn follows each other fn equally often: what a call leaves behind falls on every
        other call alike), so load from other jobs that
        comes and goes falls on all of them alike; calls under 20 ms get 4x the repeats (the
        noisiest), and each of their turns times
        calls_per_turn calls back to back (a single small call is bimodal with more ranks
        than cores; a turn's mean is not). min_seconds: more rounds (up to 8x the repeats)
        until the timed calls are forecast to take that long (from the warm-up): a cell
        whose slowest call makes it "not quick" still gets its fast calls enough turns. Also
        the CPU that processes other than the ranks used meanwhile, in cores ("other_cores";
        /proc/stat is machine-wide)."""
        t0 = time.perf_counter()
        rounds = []  # each warm-up round's seconds
        for _ in range(self.cfg["warmup"]):
            for fn in fns.values():
                fn()
            self.sync()
            rounds.append(time.perf_counter() - t0 - sum(rounds))
        per_round = (time.perf_counter() - t0) / max(1, self.cfg["warmup"])
        quick_calls = self.allsum([float(per_round < 0.02 * len(fns))], op=dist.ReduceOp.MIN)[0]
        repeats = self.cfg["repeats"] * (4 if quick_calls else 1)
        per_turn = max(1, calls_per_turn) if quick_calls else 1
        if min_seconds > 0 and rounds:  # agreed: the slowest rank's forecast, from the fastest warm-up
            # round (the first carries first-use costs: at 1 MB it forecast 2-3x the turns' time)
            forecast = self.allsum([min(rounds) * per_turn], op=dist.ReduceOp.MAX)[0]
            repeats = max(repeats, min(8 * self.cfg["repeats"], math.ceil(min_seconds / max(forecast, 1e-9))))
        times = {k: [] for k in fns}
        tx = dict.fromkeys(fns, 0)
        faults = dict.fromkeys(fns, 0)
        dist.barrier()
        wall0, busy0, own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        names = list(fns)
        cycle = balanced_sequence(len(names)) if rotate else list(range(len(names)))
        turns = -(-repeats * len(names) // len(cycle)) * len(cycle)  # whole cycles
        repeats = turns // len(names)  # each fn's turns: a cycle holds each n - 1 times of n (n - 1)
        for turn in range(turns):
            k = names[cycle[turn % len(cycle)]]
            fn = fns[k]
            dist.barrier()
            self.sync()
            tx0, f0 = _tx_bytes(self.iface), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(per_turn):
                fn()
            self.sync()
            times[k].append((time.perf_counter() - t0) / per_turn)
            faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            if self.cfg.get("iface"):  # all ranks done sending: count the call's bytes
                dist.barrier()
                tx[k] += _tx_bytes(self.iface) - tx0
        dist.barrier()
        wall, busy, own = time.perf_counter() - wall0, _busy_seconds() - busy0, _own_seconds() - own0
        own_all = self.allsum([own])[0]
        other = self.allsum([max(0.0, busy - own_all) / wall if self.rank == 0 else 0.0])[0]
        out = {}
        nodes = self.world // self.cfg["node_size"]
        for k in fns:
            slowest = self.allsum(times[k], op=dist.ReduceOp.MAX)
            per_node_tx = [0.0] * nodes
            if self.iface:
                per_node_tx[self.rank // self.cfg["node_size"]] = tx[k] / (repeats * per_turn)
            per_node_tx = self.allsum(per_node_tx)
            out[k] = {"time_s": statistics.median(slowest), "times_s": slowest,
                      "page_faults_per_call": faults[k] / (repeats * per_turn), "other_cores": other}
            if self.cfg.get("iface"):
                out[k]["wire_bytes_per_node"] = max(per_node_tx)  # the busiest uplink
                out[k]["wire_bytes"] = sum(per_node_tx)
        return out

    def accounted(self, fn, key: str) -> dict:
        """qcoll.stats() of one call, summed over ranks (every rank's bytes to its peers)."""
        qcoll.reset_stats()
        fn()
        s = qcoll.stats()[key]
        intra, inter = self.allsum([s["intra_bytes"], s["inter_bytes"]])
        return {"intra_bytes": intra, "inter_bytes": inter}

    def error(self, out: torch.Tensor, exact: torch.Tensor) -> float:
        d = (out.double().cpu() - exact)
        num, den = self.allsum([float(d.pow(2).sum()), float(exact.pow(2).sum())])
        return (num / den) ** 0.5 if den else 0.0


def _dev_args(device) -> tuple:
    if device.type == "cuda":
        return 1, device.index or 0, torch.cuda.current_stream(device).cuda_stream
    return 0, 0, 0


def _phase_times(b: "Bench", parts: dict, workspace_bytes: int, device) -> dict:
    if device.type == "cpu":
        # The call allocates its workspace each time; past glibc's mmap threshold (at most
        # 32 MB) those are fresh pages, faulted in and zeroed by the kernel on first touch.
        parts = dict(parts, workspace=lambda: torch.empty(workspace_bytes, dtype=torch.uint8)[::4096].fill_(0))
    return {name: b.time(fn)["time_s"] for name, fn in parts.items()}


def rs_phases(b: "Bench", group, inp, out, n: int) -> dict:
    """The default qgZ reduce-scatter (one stage, int8 then int4) taken apart, each part run
    alone on every rank at once: its three kernels back to back, the intra-node all-to-all,
    the inter-node all-to-all (the bytes of the real call's two hops)."""
    code, gs = CODES[inp.dtype], qcoll.DEFAULT_GROUP_SIZE
    world, ns = b.world, b.cfg["node_size"]
    nodes = world // ns
    int8, int4 = format_code(8), format_code(4)
    c1, c2 = _C.wire_chunk_bytes(int8, gs, code, n), _C.wire_chunk_bytes(int4, gs, code, n)
    u8 = dict(dtype=torch.uint8, device=inp.device)
    send1, recv1 = torch.empty(world * c1, **u8), torch.empty(world * c1, **u8)
    send2, recv2 = torch.empty(nodes * c2, **u8), torch.empty(nodes * c2, **u8)
    dev = _dev_args(inp.device)

    def kernels():
        _C.encode_chunks(inp.data_ptr(), code, n, 0, n, world, ns, nodes, int8, gs, send1.data_ptr(), c1,
                         *dev)
        # send1 has recv1's layout (node_size sources of nodes chunks): valid wire data.
        _C.reduce_chunks(send1.data_ptr(), int8, gs, code, n, ns, nodes * c1, nodes, c1, 1.0,
                         send2.data_ptr(), int4, c2, 0, code, 0, *dev)
        _C.reduce_chunks(send2.data_ptr(), int4, gs, code, n, nodes, c2, 1, 0, float(world), 0, 0, 0,
                         out.data_ptr(), code, 0, *dev)

    ws = _C.plan_reduce_scatter(world, ns, n, code, int8, int4, gs, 1, -1).workspace_bytes
    return _phase_times(b, {
        "kernels": kernels,
        "intra_hop": lambda: dist.all_to_all_single(recv1, send1, group=group.intra.pg),
        "inter_hop": lambda: dist.all_to_all_single(recv2, send2, group=group.inter.pg),
    }, ws, inp.device)


def ag_phases(b: "Bench", shard, full, n: int) -> dict:
    """The qwZ all-gather taken apart: encode + decode of every chunk; the all-gather of the
    int8 chunks."""
    code, gs = CODES[shard.dtype], qcoll.DEFAULT_GROUP_SIZE
    world = b.world
    int8 = format_code(8)
    chunk = _C.wire_chunk_bytes(int8, gs, code, n)
    send = torch.empty(chunk, dtype=torch.uint8, device=shard.device)
    recv = torch.empty(world * chunk, dtype=torch.uint8, device=shard.device)
    dev = _dev_args(shard.device)

    def encode():
        _C.encode_chunks(shard.data_ptr(), code, n, 0, n, 1, 0, 1, int8, gs, send.data_ptr(), chunk, *dev)

    def kernels():
        encode()
        _C.reduce_chunks(recv.data_ptr(), int8, gs, code, n, 1, chunk, world, chunk, 1.0, 0, 0, 0,
                         full.data_ptr(), code, n, *dev)

    encode()
    TORCH_AG(recv, send)  # valid chunks for the decode
    ws = _C.plan_all_gather(world, n, code, int8, gs).workspace_bytes
    return _phase_times(b, {"kernels": kernels, "hop": lambda: TORCH_AG(recv, send)}, ws, shard.device)


def measure(b: Bench, impls: dict, key: str, out, exact, common: dict) -> dict:
    """Rows of one collective at one size: bytes by qcoll's rule and the error of one call
    of each impl, then all impls timed taking turns. A measurement during which other
    processes used over MAX_OTHER_CORES is repeated after a pause (up to MAX_ATTEMPTS in
    all; the least disturbed kept)."""
    rows = {}
    for impl, fn in impls.items():
        rows[impl] = dict(common, impl=impl)
        if impl != "torch":
            rows[impl].update(b.accounted(fn, key))
        else:
            fn()
        rows[impl]["rel_error"] = b.error(out, exact)
    best = None
    for attempt in range(b.cfg.get("attempts", 1)):
        if attempt:
            time.sleep(2.0)  # let a burst of other work pass
        timed = b.time_interleaved(impls)
        other = next(iter(timed.values()))["other_cores"]
        if best is None or other < best[0]:
            best = (other, timed, attempt + 1)
        if other <= MAX_OTHER_CORES:
            break
    for impl in impls:
        rows[impl].update(best[1][impl], attempts=best[2])
    return rows


def pipeline_rows(b: Bench, group, cfg: dict, device) -> list:
    """Where pipelining pays: the default qgZ reduce-scatter of an fp32 gradient with
    pipeline_stages 1, 2, 4 as requested ("forced": every stage run, whatever its size) and
    as qcoll runs them ("auto": stages cut below MIN_PIPELINE_STAGE_BYTES dropped)."""
    import qcoll._runtime.steps as qcc

    rows, world, rank = [], b.world, b.rank
    for size in cfg.get("pipeline_sizes", []):
        n = max(1, size // (world * 4))
        inp = torch.cat([_values((rank, p, size, "pipe"), n, torch.float32, device) for p in range(world)])
        exact = sum(_values((q, rank, size, "pipe"), n, torch.float32, "cpu").double() for q in range(world)) / world
        out = torch.empty(n, dtype=torch.float32, device=device)

        def call(stages, min_bytes):
            def fn():
                qcc.MIN_STAGE_BYTES = min_bytes
                try:
                    qcoll.quantized_reduce_scatter(out, inp, group, pipeline_stages=stages)
                finally:
                    qcc.MIN_STAGE_BYTES = _C.MIN_PIPELINE_STAGE_BYTES
            return fn

        impls = {"stages=1": call(1, _C.MIN_PIPELINE_STAGE_BYTES)}
        for s in cfg.get("pipeline_stage_counts", [2, 4]):
            impls[f"stages={s} forced"] = call(s, 0)
            impls[f"stages={s} auto"] = call(s, _C.MIN_PIPELINE_STAGE_BYTES)
        new = measure(b, impls, "reduce_scatter", out, exact,
                      dict(collective="pipeline", bytes=size, numel_per_rank=n, dtype="fp32"))
        for impl, row in new.items():
            stages = int(impl.split("=")[1].split()[0])
            auto = not impl.endswith("forced")
            row["stages_run"] = _C.plan_reduce_scatter(
                world, cfg["node_size"], n, 0, format_code(8), format_code(4), qcoll.DEFAULT_GROUP_SIZE,
                stages, -1, True,
                _C.MIN_PIPELINE_STAGE_BYTES if auto else 0).stages
            row["vs_one_stage"] = new["stages=1"]["time_s"] / row["time_s"]
        rows += new.values()
    return rows


def overlap_rows(b: Bench, group, cfg: dict, device) -> list:
    """Real asynchrony: a qwZ all-gather issued with async_op=True, then a matmul in the
    caller, then wait(); against the same two one after the other. The matmul is sized to
    take about as long as the gather alone."""
    rows, world, rank = [], b.world, b.rank
    for size in cfg.get("overlap_sizes", []):
        n = max(1, size // (world * 2))
        shard = _values((rank, size, "overlap"), n, torch.bfloat16, device)
        full, sync_full = (torch.empty(world * n, dtype=torch.bfloat16, device=device) for _ in range(2))
        qcoll.quantized_allgather(sync_full, shard, group)
        gather_s = b.time(lambda: qcoll.quantized_allgather(full, shard, group))["time_s"]
        m = 256
        a = torch.randn(m, m, device=device)
        t0 = time.perf_counter()
        a @ a
        reps = max(1, int(gather_s / max(time.perf_counter() - t0, 1e-6)))
        reps = int(b.allsum([reps], op=dist.ReduceOp.MIN)[0])

        def compute():
            for _ in range(reps):
                a @ a

        def sequential():
            qcoll.quantized_allgather(full, shard, group)
            compute()

        def overlapped():
            work = qcoll.quantized_allgather(full, shard, group, async_op=True)
            compute()
            work.wait()

        timed = b.time_interleaved({"sequential": sequential, "async": overlapped, "matmul": compute})
        identical = bool(b.allsum([float(torch.equal(full, sync_full))], op=dist.ReduceOp.MIN)[0])
        for impl, t in timed.items():
            rows.append(dict(t, collective="overlap", impl=impl, bytes=size, numel_per_rank=n, dtype="bf16",
                             rel_error=0.0, bit_identical_to_sync=identical, gather_alone_s=gather_s,
                             vs_sequential=timed["sequential"]["time_s"] / t["time_s"]))
    return rows


def all_reduce_rows(b: Bench, group, cfg: dict, device, size: int, dtype, stages) -> list:
    """qcoll.quantized_all_reduce (int8 in the node, int4 across: the DDP hook's defaults)
    against torch's all_reduce of the same tensor (`size` bytes; gloo has no AVG: SUM then
    divide) and the same baseline through qcoll (bits=None: the path
    policy.unquantized_host_all_reduce takes, from 4 ranks the raw exchange, counted by
    qcoll's rule). Each call starts from
    a copy of the input (every impl pays the same copy)."""
    world, rank = b.world, b.rank
    numel = max(1, size // dtype.itemsize)
    x = _values((rank, size, "ar"), numel, dtype, device)
    exact = sum(_values((q, size, "ar"), numel, dtype, "cpu").double() for q in range(world)) / world
    buf = torch.empty_like(x)
    native_avg = device.type == "cuda"

    def torch_ar():
        buf.copy_(x)
        dist.all_reduce(buf, op=dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM)
        if not native_avg:
            buf.div_(world)

    def via_qcoll():
        buf.copy_(x)
        qcoll.quantized_all_reduce(buf, group, bits=None, hierarchical=False)

    def quantized():
        buf.copy_(x)
        qcoll.quantized_all_reduce(buf, group, bits=8, inter_bits=4, pipeline_stages=stages or 2)

    impls = {"torch": torch_ar, "torch-via-qcoll": via_qcoll, "qcoll": quantized}
    rows = measure(b, impls, "all_reduce", buf, exact,
                   dict(collective="all_reduce", bytes=size, numel=numel, dtype=cfg["dtype"]))
    return list(rows.values())


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    world, node_size = cfg["world"], cfg["node_size"]
    torch.set_num_threads(1)
    device = torch.device(cfg["device"])
    timeout = datetime.timedelta(seconds=cfg.get("timeout_s", 300))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{cfg['store']}", rank=rank,
                                world_size=world, timeout=timeout, device_id=torch.device("cuda", 0))
        group = qcoll.new_group(node_size=node_size)
    else:
        dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank,
                                world_size=world, timeout=timeout)
        group = qcoll.new_group(node_size=node_size, backend="torch")
    b = Bench(cfg, rank)
    dtype = DTYPES[cfg["dtype"]]
    stages = cfg.get("pipeline_stages")
    is_nccl = device.type == "cuda"
    rows, done = [], 0
    total = len(cfg["sizes"])
    for size in cfg["sizes"]:
        if cfg.get("all_reduce", True):
            rows += all_reduce_rows(b, group, cfg, device, size, dtype, stages)
        if cfg.get("all_reduce_only"):
            done += 1
            if rank == 0:
                print(f"PROGRESS {done} {total}", flush=True)
            continue
        n = max(1, size // (world * dtype.itemsize))  # elements per rank's shard
        # ---- reduce-scatter: input = world partitions; rank r keeps op over partition r.
        inp = torch.cat([_values((rank, p, size, "rs"), n, dtype, device) for p in range(world)])
        exact = sum(_values((q, rank, size, "rs"), n, dtype, "cpu").double() for q in range(world)) / world
        out = torch.empty(n, dtype=dtype, device=device)

        def torch_rs():
            if is_nccl:
                TORCH_RS(out, inp, op=dist.ReduceOp.AVG)
            else:  # gloo has no AVG
                TORCH_RS(out, inp, op=dist.ReduceOp.SUM)
                out.div_(world)

        impls = {
            "torch": torch_rs,
            "torch-via-qcoll": lambda: qcoll.quantized_reduce_scatter(
                out, inp, group, intra_bits=None, inter_bits=None, hierarchical=False),
            "qcoll": lambda: qcoll.quantized_reduce_scatter(out, inp, group, pipeline_stages=stages),
        }
        new = measure(b, impls, "reduce_scatter", out, exact,
                      dict(collective="reduce_scatter", bytes=size, numel_per_rank=n, dtype=cfg["dtype"]))
        if cfg.get("phases") and group.num_nodes > 1 and group.node_size > 1:
            new["qcoll"]["phases_s"] = rs_phases(b, group, inp, out, n)
        rows += new.values()
        del inp, out
        # ---- all-gather: output = every rank's shard, in rank order.
        shard = _values((rank, size, "ag"), n, dtype, device)
        exact = torch.cat([_values((q, size, "ag"), n, dtype, "cpu").double() for q in range(world)])
        full = torch.empty(world * n, dtype=dtype, device=device)
        impls = {
            "torch": lambda: TORCH_AG(full, shard),
            "torch-via-qcoll": lambda: qcoll.quantized_allgather(full, shard, group, bits=None),
            "qcoll": lambda: qcoll.quantized_allgather(full, shard, group, bits=8),
        }
        new = measure(b, impls, "allgather", full, exact,
                      dict(collective="allgather", bytes=size, numel_per_rank=n, dtype=cfg["dtype"]))
        if cfg.get("phases"):
            new["qcoll"]["phases_s"] = ag_phases(b, shard, full, n)
        rows += new.values()
        del shard, full
        done += 1
        if rank == 0:
            print(f"PROGRESS {done} {total}", flush=True)
    rows += pipeline_rows(b, group, cfg, device)
    rows += overlap_rows(b, group, cfg, device)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"rows": rows, "backend": dist.get_backend(),
                       "torch_calls": [TORCH_AG.__name__, TORCH_RS.__name__]}, f)
    dist.barrier()
    qcoll.destroy()  # qcoll's groups first, while the interpreter lives (as the README's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
