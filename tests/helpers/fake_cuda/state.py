"""The session in progress (one per process at a time), read by the tensor's repr and by
code that needs to know whether it runs under the instrument."""
from __future__ import annotations

_ACTIVE = None


def active():
    """The Recorder of the session in progress, or None."""
    return _ACTIVE


def set_active(rec) -> None:
    global _ACTIVE
    _ACTIVE = rec
