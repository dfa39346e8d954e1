"""Bytes this rank handed to the transport, per collective, since the last reset."""

from . import _C


def stats() -> dict:
    """{"allgather": {"calls", "intra_bytes", "inter_bytes"}, "reduce_scatter": {...}}.

    One rule for every path, baseline included: the bytes this rank must deliver to each
    peer, as if exchanged directly (payload, scales and padding counted), split by whether
    the peer is on this rank's node (intra) or another node (inter).
    """
    return _C.stats()


def reset_stats() -> None:
    _C.reset_stats()


# ---- what one call sends, by the same rule, without running it ----------------------------
# Callers that must attribute bytes to their own calls (qcoll.zero's engine) cannot diff the
# process-wide counters once calls run asynchronously and interleave; these read the plan the
# call will use and apply the transport's rule (bytes per peer x peers on / off the node).
def _peer_bytes(bytes_per_peer: int, size: int, node_size: int) -> tuple:
    local = min(node_size, size) - 1
    return bytes_per_peer * local, bytes_per_peer * (size - 1 - local)


def allgather_traffic(numel: int, dtype, group, *, bits=8, group_size=None) -> dict:
    """{"calls": 1, "intra_bytes", "inter_bytes"} that quantized_allgather(output, input of
    `numel` elements, group, bits=bits, group_size=group_size) adds to stats()."""
    from ._dtypes import dtype_code
    from .group import resolve_group
    from .quantization import check_group_size

    g = resolve_group(group)
    plan = _C.plan_all_gather(g.size, numel, dtype_code(dtype, "dtype"), 0 if bits is None else bits,
                              check_group_size(group_size))
    per_peer = plan.chunk if bits is not None else numel * dtype.itemsize
    intra, inter = _peer_bytes(per_peer, g.size, g.node_size)
    return {"calls": 1, "intra_bytes": intra, "inter_bytes": inter}


def reduce_scatter_traffic(numel: int, dtype, group, *, intra_bits=8, inter_bits=4, group_size=None,
                           pipeline_stages=None, hierarchical=None) -> dict:
    """{"calls": 1, "intra_bytes", "inter_bytes"} that quantized_reduce_scatter(output of
    `numel` elements, input, group, ...) adds to stats()."""
    from ._dtypes import dtype_code
    from .group import resolve_group
    from .quantization import check_group_size

    g = resolve_group(group)
    plan = _C.plan_reduce_scatter(g.size, g.node_size, numel, dtype_code(dtype, "dtype"),
                                  0 if intra_bits is None else intra_bits, 0 if inter_bits is None else inter_bits,
                                  check_group_size(group_size), pipeline_stages or 1,
                                  -1 if hierarchical is None else int(hierarchical))
    intra = inter = 0
    if not plan.two_hop and plan.first_bits == 0:  # the transport's own reduce-scatter
        intra, inter = _peer_bytes(numel * dtype.itemsize, g.size, g.node_size)
    elif numel and not plan.two_hop:
        per_peer = sum(plan.first_chunk(s) for s in range(plan.stages) if plan.slice_len(s) > 0)
        intra, inter = _peer_bytes(per_peer, g.size, g.node_size)
    elif numel:
        nodes = g.size // g.node_size
        live = [s for s in range(plan.stages) if plan.slice_len(s) > 0]
        intra = sum(nodes * plan.first_chunk(s) for s in live) * (g.node_size - 1)  # intra hop
        inter = sum(plan.second_chunk(s) for s in live) * (nodes - 1)  # inter hop, all remote
    return {"calls": 1, "intra_bytes": intra, "inter_bytes": inter}
