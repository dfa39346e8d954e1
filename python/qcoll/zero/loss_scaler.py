"""Loss scaling for fp16 compute: scale the loss so small gradients survive fp16, skip
steps whose gradients overflowed (detected on every rank, through quantization too: a
non-finite value makes its whole quantization group NaN)."""

from __future__ import annotations

from typing import Optional


class LossScaler:
    def __init__(self, enabled: bool, static_scale: Optional[float], initial: float, window: int):
        self.enabled = enabled
        self.dynamic = enabled and static_scale is None
        self.scale = (static_scale if static_scale is not None else initial) if enabled else 1.0
        self.window = window
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.window:
            self.scale *= 2.0
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "dynamic": self.dynamic, "scale": self.scale,
                "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
