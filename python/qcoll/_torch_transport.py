"""Transports the C++ collectives call back into: a torch.distributed ProcessGroup, and a
trivial one for a group of one rank. Each exchange comes with the calling core call's own
buffers (_runtime/buffers.py's CallBuffers, passed through the core) and addresses them
by (buffer id, byte offset)."""

from __future__ import annotations

import collections.abc
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import _C, _log
from ._runtime.worker import CommunicationError
_SUM, _AVG = _C.OPS["sum"], _C.OPS["avg"]  # the core's ReduceOp codes

# torch >= 2.9 names; older releases only have the *_into_tensor / *_tensor ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The all-gather's send buffer (the rank's bytes once per rank) and the host reduce-scatter's
# buffer (below) are kept for the next call up to this size; a larger one is allocated per
# call rather than held.
_KEEP_BUFFER_BYTES = 64 << 20
# Over a group with ranks on several nodes and several per node, the all-to-all sends every
# chunk across nodes from each rank (3 x 2: 8 chunks leave a node, against the ring's 5). Up
# to this size it gathers that way: there the ring's size - 1 waiting steps cost more than the
# extra bytes even on a 1 Gbit/s link. Past it neither path is faster everywhere (on
# loopback the all-to-all took 152-159 against gloo's ring's 260-264 ms for 64 MB of bf16 on
# 3 x 2, and the ring posted as steps 0.36x gloo's at 64 MB on 6 local ranks; on a slow
# link the extra bytes cost more), so the transport measures (GatherPaths).
ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES = 256 << 10
# Past this many gathered bytes the all-to-all pattern is posted as send/recv pairs of the
# rank's bytes to every peer (gather_pg.send/recv) rather than one all-to-all of a buffer
# holding them once per rank: the copy into that buffer writes all the gathered bytes again.
# 6 gloo ranks, bf16 (pairs / all-to-all with the copy): 64 MB 99-110 / 142-156 ms, 16 MB
# 31 / 38 ms, 4 MB 5.6 / 6.6 ms, 2 MB even, 1 MB 4.5 / 3.7 ms: the 2 (size - 1) posted
# operations cost more than the copy there (bench/results/probe-gloo-gather-pairs-cpu.txt).
# A band edge (gather_band): the band (1 MB, 4 MB] that holds the crossover takes the pairs
# whole, so that a band's trial (GatherPaths) times the path its later gathers take. Past it
# the ring too is posted as send/recv steps (ProcessGroupTransport._gather_by_ring).
PAIRS_GATHER_ABOVE_BYTES = 1 << 20
# The tag of the call check's send/recv pairs on gather_pg (the pairs and the ring's steps
# use tag 0):
# gloo matches pairs by tag, apart from each other and from its collectives. (On the
# ProcessGroup of the other exchanges, send/recv pairs slowed the gloo all-reduces after
# them: see ProcessGroupTransport.)
CALL_CHECK_TAG = 0x5143


def measures_gather_path(size: int, node_size: int, gathered_bytes: int) -> bool:
    """Whether the gloo transport of a group of `size` ranks, `node_size` per node, chooses
    how to gather `gathered_bytes` of host tensors by timing both paths (GatherPaths); where
    not, it gathers them by the all-to-all (a group without a gather ProcessGroup, or GPU
    tensors: always the ProcessGroup's own all-gather)."""
    spans_tiers = 1 < node_size < size
    return spans_tiers and gathered_bytes > ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES


# The two paths GatherPaths chooses between, by the names describe() and the cost model use.
GATHER_PATHS = ("ring", "all_to_all")


def check_gather_paths(paths, what: str) -> dict:
    """paths ({size band: one of GATHER_PATHS}) as a dict sorted by band; ValueError naming
    `what` otherwise."""
    if not isinstance(paths, collections.abc.Mapping) or any(
            isinstance(band, bool) or not isinstance(band, int) or band < 1 or path not in GATHER_PATHS
            for band, path in paths.items()):
        raise ValueError(f"{what} maps size bands (ints >= 1) to one of {GATHER_PATHS}; got {paths!r}")
    return dict(sorted(paths.items()))


def gather_band(gathered_bytes: int) -> int:
    """The size band k of a gather: gathered bytes in (4^(k-1), 4^k]."""
    return (max(1, gathered_bytes) - 1).bit_length() + 1 >> 1


def band_bounds(band: int) -> tuple:
    """(low, high): a band's gathered bytes are in (low, high]."""
    return 4 ** (band - 1), 4 ** band


class GatherPaths:
    """Which path a spanning group's transport gathers each size band by (True: the
    all-to-all, False: the ring), chosen at the band's first gather: each path timed
    twice (ring, all-to-all, all-to-all, ring), each path's faster time kept, the slowest
    rank's taken by an all-reduce (MAX); the all-to-all only where strictly faster. With one
    trial per path, one disturbed all-to-all chose the ring for a band whose neighbours
    both took the all-to-all (auto suite, 3 x 2 at 10 Gbit/s: 31 against the ring's 20 ms at
    2 MB, where 8 MB took 32). Every rank runs the same gathers and holds the same choice;
    results are identical either way (a gather moves bytes unchanged). Only a band's first
    gather pays: 3 gathers more than the call's one, and a 16-byte all-reduce (neither
    counted in qcoll.stats()). A band the group's cost model names is gathered by the
    model's path instead, untimed (adopt), so that the model prices the path its calls take."""

    def __init__(self):
        # band -> (by all-to-all, ring s, all-to-all s), the times None where adopted: one
        # record, set at once, so that a reader on another thread never sees half of it.
        self.chosen = {}

    def describe(self) -> dict:
        """{(low, high): {"path": "all_to_all" | "ring", "measured_s": {"ring": s,
        "all_to_all": s}}} for gathered bytes in (low, high]; "measured_s" None for a band
        whose path was adopted from the cost model (adopt)."""
        return {band_bounds(band): {"path": GATHER_PATHS[int(by_all_to_all)],
                                    "measured_s": None if ring is None else {"ring": ring, "all_to_all": all_to_all}}
                for band, (by_all_to_all, ring, all_to_all) in sorted(dict(self.chosen).items())}

    def adopt(self, paths: dict) -> list:
        """Take {band: "ring" | "all_to_all"} (CostModel.gather_paths) as the bands' paths,
        measured or not: the bands whose path changed. The caller keeps every rank's choices
        the same: all ranks adopt the same paths at the same point between calls."""
        changed = []
        for band, path in paths.items():
            by_all_to_all = GATHER_PATHS.index(path) == 1
            known = self.chosen.get(band)
            if known is None or known[0] != by_all_to_all:
                self.chosen[band] = (by_all_to_all, None, None)
                changed.append(band)
        return changed

    def choose(self, gather, agree, band: int) -> bool:
        """gather(by_all_to_all) runs the gather once; agree(tensor) all-reduces it (MAX)
        in place over the group."""
        best = {False: float("inf"), True: float("inf")}
        for path in (False, True, True, False):  # in turn: a drift in the machine hits both
            best[path] = min(best[path], _timed(gather, path))
        times = torch.tensor([best[False], best[True]], dtype=torch.float64)
        agree(times)
        ring, all_to_all = times.tolist()
        choice = all_to_all < ring
        self.chosen[band] = (choice, ring, all_to_all)
        return choice


def _sends_apart(send, recv, rank: int) -> bool:
    """Whether `send` is either the rank's own slot of `recv` or apart from all of recv, so
    that no gather path overwrites it before it is sent (the pairs send `send` itself while
    the peers' bytes land in recv; a band's trials send it several times)."""
    nbytes = send.numel() * send.element_size()
    start, end = send.data_ptr(), send.data_ptr() + nbytes
    low = recv.data_ptr()
    return start == low + rank * nbytes or end <= low or start >= low + recv.numel() * recv.element_size()


def _copy_own_slot(own_slot, send) -> None:
    """The rank's own slot of a gather's output: `send`, unless it already is that slot
    (an in-place gather; _sends_apart admits no other overlap)."""
    if own_slot.data_ptr() != send.data_ptr():
        own_slot.copy_(send)


def _timed(gather, by_all_to_all: bool) -> float:
    start = time.perf_counter()
    gather(by_all_to_all)
    return time.perf_counter() - start


class ProcessGroupTransport:
    """Exchanges over a ProcessGroup qcoll owns. `label` names the group in errors (for a
    2-hop call, which hop failed).

    gather_pg: a second ProcessGroup over the same ranks (gloo), for all-gathers. gloo's
    all-gather is a ring of size - 1 steps, each waiting for the one before; its all-to-all
    posts every pair at once, so the transport gathers by an all-to-all of its bytes sent to
    every rank: 117-162 against 261-290 ms for 64 MB on 6 ranks, 0.7-0.8x from 1 KB on 4
    (bench/results/probe-gloo-all-gather-a2a-cpu.txt); over nodes of several ranks, up to
    ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES, and past it by whichever path measured faster at the
    size band's first gather (GatherPaths); past PAIRS_GATHER_ABOVE_BYTES the all-to-all
    pattern is posted as send/recv pairs (no buffer of the bytes once per rank), and the
    ring as send/recv steps into the output (no fresh buffer per call). On the
    ProcessGroup of the other exchanges it slowed the gloo all-reduces after it (1.03x ->
    1.38-1.42x torch's at 4 MB on 2 x 2, like the send/recv pairs of abcf3d3; cause not
    found); on a group of its own it does not, pairs included."""

    def __init__(self, pg, label: str, gather_pg=None, node_size: int = 1):
        self.pg = pg
        self.gather_pg = gather_pg
        self.rank = dist.get_rank(pg)  # the same in gather_pg: the same ranks in the same order
        self.node_size = node_size
        self.size = dist.get_world_size(pg)
        self.label = label
        self.is_nccl = dist.get_backend(pg) == "nccl"
        self.is_gloo = "gloo" in str(dist.get_backend(pg))  # gloo's host collectives (a "cpu:gloo,..." mix too)
        # The ProcessGroup's own methods where this torch has them (>= 2.9): the same
        # collectives as torch.distributed's functions without their Python wrapper, which
        # costs ~0.1 ms a call, several times per qcoll call (issue 26).
        self._direct = all(hasattr(pg, m) for m in ("all_gather_single", "reduce_scatter_single",
                                                    "all_to_all_single", "allreduce")) and all(
            hasattr(c10d, o) for o in ("AllgatherOptions", "AllToAllOptions", "ReduceScatterOptions",
                                       "AllreduceOptions"))
        self._opts = {}
        self._replicas = None  # the all-gather's send buffer, kept for the next call
        self._reduced = None  # the host reduce-scatter's all-reduce buffer, kept likewise
        self.gather_paths = GatherPaths()

    def _options(self, kind, op=None):
        opts = self._opts.get((kind, op))
        if opts is None:
            opts = kind()
            if op is not None:
                opts.reduceOp = op
            self._opts[(kind, op)] = opts
        return opts

    def _failed(self, what: str, exc: Exception) -> CommunicationError:
        hint = ""
        if "timed out" in str(exc).lower():  # a peer that is alive but elsewhere looks the same
            hint = (" (a peer died or stalled, or is making another call: QCOLL_DEBUG=1 compares "
                    "every call's arguments across ranks first)")
        return CommunicationError(f"{what} over {self.label}: {type(exc).__name__}: {exc}{hint}")

    def all_to_all(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        send, recv = buffers.pair(send_id, send_off, self.size * nbytes, recv_id, recv_off,
                                  self.size * nbytes, nbytes)
        try:
            if self._direct:
                self.pg.all_to_all_single(recv, send, [], [], self._options(c10d.AllToAllOptions)).wait()
            else:
                dist.all_to_all_single(recv, send, group=self.pg)
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise self._failed("all-to-all", exc) from exc

    def all_gather(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        send, recv = buffers.pair(send_id, send_off, nbytes, recv_id, recv_off, self.size * nbytes, nbytes)
        if send.device.type == "cpu" and not _sends_apart(send, recv, self.rank):
            # Bytes that are another slot of the output: copied first, so that every path
            # (and each of a band's trials) sends them intact. The copy, not a path of its
            # own: an overlap is this rank's alone, and every rank must post the same path.
            send = send.clone()
        measured = None  # the band this gather chose a path for
        try:
            if self.gather_pg is None or send.device.type != "cpu":
                self._gather(recv, send, False)
            elif not measures_gather_path(self.size, self.node_size, self.size * nbytes):
                self._gather(recv, send, True)
            else:
                band = gather_band(self.size * nbytes)
                chosen = self.gather_paths.chosen.get(band)
                if chosen is None:  # the band's first gather: the trials leave it in recv
                    agree = lambda values: self._all_reduce(values, dist.ReduceOp.MAX)  # noqa: E731
                    self.gather_paths.choose(lambda path: self._gather(recv, send, path), agree, band)
                    measured = band
                else:
                    self._gather(recv, send, chosen[0])
        except Exception as exc:  # noqa: BLE001
            raise self._failed("all-gather", exc) from exc
        if measured is not None:
            self._log_choice(measured)

    def exchange_call_headers(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        """The call check's all-gather of 32-byte headers, as send/recv pairs tagged
        CALL_CHECK_TAG: gloo matches those apart from every collective, so a rank that checks
        a signature its peers agreed on before (they skip to the payload) waits for them
        until the timeout, naming the likely cause, instead of taking their payload for
        headers or they its header for payload."""
        if self.gather_pg is None:  # (an NCCL ProcessGroup: no host calls, so no checks)
            return self.all_gather(buffers, send_id, send_off, recv_id, recv_off, nbytes)
        send, recv = buffers.pair(send_id, send_off, nbytes, recv_id, recv_off, self.size * nbytes, nbytes)
        slots = recv.view(self.size, -1)
        peers = [p for p in range(self.size) if p != self.rank]
        try:
            works = [self.gather_pg.recv([slots[p]], p, CALL_CHECK_TAG) for p in peers]
            works += [self.gather_pg.send([send], p, CALL_CHECK_TAG) for p in peers]
            _copy_own_slot(slots[self.rank], send)
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise CommunicationError(
                f"the call check over {self.label}: {type(exc).__name__}: {exc} (a peer died or "
                f"stalled, or is making another call, one whose signature the group agreed on "
                f"before, so it skipped the check; QCOLL_DEBUG=1 compares every call's arguments "
                f"across ranks first)") from exc

    def _gather(self, recv, send, by_all_to_all: bool):
        as_send_recv = (self.gather_pg is not None and send.device.type == "cpu"
                        and recv.numel() * recv.element_size() > PAIRS_GATHER_ABOVE_BYTES)
        if as_send_recv:
            (self._gather_by_pairs if by_all_to_all else self._gather_by_ring)(recv, send)
        elif by_all_to_all and self._direct:
            self.gather_pg.all_to_all_single(recv, self._replicated(send), [], [],
                                             self._options(c10d.AllToAllOptions)).wait()
        elif by_all_to_all:
            dist.all_to_all_single(recv, self._replicated(send), group=self.gather_pg)
        elif self._direct:
            self.pg.all_gather_single(recv, send, self._options(c10d.AllgatherOptions)).wait()
        else:
            _all_gather(recv, send, group=self.pg)

    def _gather_by_pairs(self, recv, send):
        """The all-to-all pattern without the replicated buffer: every receive posted, then
        `send` itself sent to every peer (peer rank + k receives it while rank - k's bytes
        arrive, as the all-to-all pairs them), then the rank's own slot copied."""
        pg, size, rank = self.gather_pg, self.size, self.rank
        slots = recv.view(size, -1)
        sources = [(rank - k) % size for k in range(1, size)]
        works = [pg.recv([slots[source]], source, 0) for source in sources]
        works += [pg.send([send], (rank + k) % size, 0) for k in range(1, size)]
        _copy_own_slot(slots[rank], send)
        for work in works:
            work.wait()

    def _gather_by_ring(self, recv, send):
        """gloo's ring as send/recv steps straight into the output's slots: at step s each
        rank forwards slot rank - s to the next rank and receives slot rank - s - 1 from the
        one before (the ring's order and cross-node bytes). gloo's own all-gather gathers
        into a fresh flat buffer and copies it out, and its input flattened, per call:
        past glibc's 32 MB mmap ceiling a page fault per 4 KB every call, and on loopback
        1.5-3x these steps' time from 16 MB (bench/results/probe-gloo-ring-by-pairs-cpu.txt)."""
        pg, size, rank = self.gather_pg, self.size, self.rank
        slots = recv.view(size, -1)
        _copy_own_slot(slots[rank], send)
        after, before = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            works = [pg.recv([slots[(rank - step - 1) % size]], before, 0),
                     pg.send([slots[(rank - step) % size]], after, 0)]
            for work in works:
                work.wait()

    def adopt_gather_paths(self, paths: dict) -> None:
        """Gather the size bands `paths` names (CostModel.gather_paths) by its paths, without
        trials (GatherPaths.adopt: every rank at the same point between calls); only bands
        this transport chooses a path for (others it never measures, whatever a model says)."""
        if self.gather_pg is None:
            return
        ours = {band: path for band, path in paths.items()
                if measures_gather_path(self.size, self.node_size, band_bounds(band)[1])}
        for band in self.gather_paths.adopt(ours):
            self._log_choice(band)

    def _log_choice(self, band: int):
        if self.rank != 0 or not _log.enabled("transport"):
            return
        by_all_to_all, ring, all_to_all = self.gather_paths.chosen[band]
        low, high = band_bounds(band)
        path = "the all-to-all" if by_all_to_all else "the ring"
        why = ("the group's cost model" if ring is None
               else f"measured: ring {ring * 1e3:.2f} ms, all-to-all {all_to_all * 1e3:.2f} ms")
        _log.emit(f"qcoll transport: all-gathers of ({low >> 10}, {high >> 10}] KB over {self.label} by "
                  f"{path} ({why})")

    def _all_reduce(self, values, reduce):
        """values all-reduced in place over the ProcessGroup."""
        if self._direct:
            self.pg.allreduce([values], self._options(c10d.AllreduceOptions, reduce)).wait()
        else:
            dist.all_reduce(values, op=reduce, group=self.pg)

    def _kept(self, attr: str, nbytes: int) -> torch.Tensor:
        """A host byte buffer of at least nbytes: the one kept in `attr` when it is large
        enough, else a new one, kept for the next call up to _KEEP_BUFFER_BYTES."""
        buf = getattr(self, attr)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes <= _KEEP_BUFFER_BYTES:
                setattr(self, attr, buf)
        return buf[:nbytes]

    def release_buffers(self) -> None:
        """Drops the buffers kept for the next call (the group is closing)."""
        self._replicas = self._reduced = None

    def _replicated(self, send):
        """`send` once per rank, one after the other (the all-to-all's input)."""
        nbytes = self.size * send.numel() * send.element_size()
        rows = self._kept("_replicas", nbytes).view(send.dtype).view(self.size, -1)
        rows.copy_(send.view(1, -1).expand(self.size, -1))
        return rows.view(-1)

    def reduce_scatter(self, buffers, send_id, send_off, recv_id, recv_off, count, dtype_code, op):
        send = buffers.typed(send_id, send_off, self.size * count, dtype_code)
        recv = buffers.typed(recv_id, recv_off, count, dtype_code)
        native_avg = op == _AVG and self.is_nccl
        reduce = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        try:
            if self.is_gloo and send.device.type == "cpu":
                self._reduce_scatter_by_all_reduce(recv, send, reduce)
            elif self._direct:
                self.pg.reduce_scatter_single(recv, send, self._options(c10d.ReduceScatterOptions, reduce)).wait()
            else:
                _reduce_scatter(recv, send, op=reduce, group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise self._failed("reduce-scatter", exc) from exc
        if op == _AVG and not native_avg:  # gloo has no AVG
            recv.div_(self.size)

    def _reduce_scatter_by_all_reduce(self, recv, send, reduce):
        """gloo's reduce-scatter as gloo runs it (torch's ProcessGroupGloo: an all-reduce of
        a copy of the input, then this rank's part), in a buffer kept for the next call
        rather than one allocated per call: the same sums, bit for bit, without the page
        faults of a fresh buffer of the input's size (from 32 MB glibc maps one per call).
        At 32 and 64 MB on 4 and 6 ranks, bf16 and fp32, one thread per rank: 0.65-0.78x
        torch's call's time; about 1x below (bench/results/probe-gloo-reduce-scatter-cpu.txt)."""
        values = self._kept("_reduced", send.numel() * send.element_size()).view(send.dtype)
        values.copy_(send)
        self._all_reduce(values, reduce)
        recv.copy_(values[self.rank * recv.numel():(self.rank + 1) * recv.numel()])

    def all_reduce(self, buffers, buf_id, offset, count, dtype_code, op):
        values = buffers.typed(buf_id, offset, count, dtype_code)
        native_avg = op == _AVG and self.is_nccl
        reduce = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        try:
            self._all_reduce(values, reduce)
        except Exception as exc:  # noqa: BLE001
            raise self._failed("all-reduce", exc) from exc
        if op == _AVG and not native_avg:
            values.div_(self.size)


class SelfTransport:
    """A group of one rank: every exchange is a local copy."""

    def all_to_all(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        buffers.bytes(recv_id, recv_off, nbytes).copy_(buffers.bytes(send_id, send_off, nbytes))

    all_gather = exchange_call_headers = all_to_all

    def all_reduce(self, buffers, buf_id, offset, count, dtype_code, op):
        pass  # one rank: the values are the result

    def reduce_scatter(self, buffers, send_id, send_off, recv_id, recv_off, count, dtype_code, op):
        recv = buffers.typed(recv_id, recv_off, count, dtype_code)
        recv.copy_(buffers.typed(send_id, send_off, count, dtype_code))
