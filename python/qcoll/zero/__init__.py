"""A small ZeRO-3 engine on qcoll's collectives: qwZ, hpZ and qgZ for any nn.Module."""

from .config import ZeroConfig
from .engine import ZeroEngine

__all__ = ["ZeroConfig", "ZeroEngine"]
