"""QCOLL_LOG: the comma-separated topics qcoll explains on stderr, read in one place.

  policy     each distinct decision of policy="auto", with its predicted times (qcoll.auto)
  transport  each size band's gather path the gloo transport measured (_torch_transport)
"""

from __future__ import annotations

import os
import sys
import warnings

TOPICS = ("policy", "transport")
_warned = set()  # the unknown settings already warned about


def enabled(topic: str) -> bool:
    """Whether QCOLL_LOG names `topic` (read at each call: a test or a user may set it late).
    An unknown topic warns once, naming the known ones, rather than logging nothing silently."""
    setting = os.environ.get("QCOLL_LOG", "")
    topics = {t.strip() for t in setting.split(",") if t.strip()}
    unknown = sorted(topics.difference(TOPICS))
    if unknown and setting not in _warned:
        _warned.add(setting)
        warnings.warn(f"QCOLL_LOG={setting!r}: unknown topic(s) {', '.join(unknown)}; "
                      f"known: {', '.join(TOPICS)}", stacklevel=3)
    return topic in topics


def emit(line: str) -> None:
    """One line to stderr; a closed or broken stderr loses the line, never the call that
    logs it (which runs on rank 0 alone: raising there would leave the peers waiting)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a broken pipe; a closed file
        pass
