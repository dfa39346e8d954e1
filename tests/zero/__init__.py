"""The ZeRO engine (qcoll.zero)."""
