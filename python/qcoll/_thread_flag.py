"""A per-thread switch, on inside `with flag.on():` blocks (nested blocks restore it)."""

from __future__ import annotations

import contextlib
import threading


class ThreadFlag:
    """True on the threads inside one of its `on()` blocks, False elsewhere. Pure Python:
    qcoll._vgpu uses it before the core is loaded."""

    def __init__(self):
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "set", False)

    @contextlib.contextmanager
    def on(self):
        previous = getattr(self._local, "set", False)
        self._local.set = True
        try:
            yield
        finally:
            self._local.set = previous
