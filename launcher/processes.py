"""Child processes of the launcher: they must not outlive it."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """``preexec_fn`` of every child: it gets SIGTERM when its parent dies, so a killed launcher leaves no
    orphan (Linux; elsewhere children must be stopped by the launcher itself)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
