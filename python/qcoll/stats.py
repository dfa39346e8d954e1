"""Bytes this rank handed to the transport, per collective, since the last reset."""

from . import _C, auto


def stats() -> dict:
    """{"allgather" | "reduce_scatter" | "all_reduce": {"calls", "intra_bytes",
    "inter_bytes", "header_bytes"}, "auto": {...}}.

    One rule for every path, baseline included: the bytes this rank must deliver to each
    peer, as if exchanged directly (payload, scales and padding counted), split by whether
    the peer is on this rank's node (intra) or another node (inter).
    "auto": {kind: {choice: calls}} of the calls made with policy="auto" (qcoll.auto).
    header_bytes: the wire headers' share of intra + inter bytes. The cost probe's own
    calls are not counted.
    """
    return dict(_C.stats(), auto=auto.counts())


def reset_stats() -> None:
    _C.reset_stats()
    auto.reset_counts()
