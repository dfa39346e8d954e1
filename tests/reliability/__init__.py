"""Mismatched calls, dead peers, timeouts and async failures."""
