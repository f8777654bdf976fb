"""Child processes of the launcher: they must not outlive it, they stop in the launcher's order, and the
launcher knows the last thing each one said before it failed.

- ``detach``: every child's ``preexec_fn`` (``detach_service`` for services). Its own process group, so
  a terminal's Ctrl-C (SIGINT to the foreground group) reaches the launcher alone, which then stops the
  children in order (the frontend, the workers, the MPS daemon last); and SIGTERM when the launcher dies,
  so a killed launcher leaves no orphan (Linux; elsewhere children must be stopped by the launcher itself).
- ``OutputTail``: a child's stderr, forwarded line by line to the launcher's own by a thread that always
  reads it (so the pipe never fills and stalls the child), keeping the child's last error line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from typing import IO

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CONSOLE_ERROR = re.compile(r"\[(error|critical)\s*\]")  # structlog's console renderer
_STDLIB_ERROR = re.compile(r"^\S+ (ERROR|CRITICAL) ")  # the standard library's loggers (``shared/logging.py``)


def detach() -> None:
    os.setpgid(0, 0)
    die_with_parent()


def detach_service() -> None:
    """``detach``, and SIGTERM held until the service can act on it (``Service.run`` releases it): a stop
    that comes while it still imports its libraries then ends it as any stop does (exit status 0), not by
    the signal's default action."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    detach()


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class OutputTail:
    """Forwards ``pipe`` (a child's stderr) to file descriptor ``sink`` and keeps its last error line:
    the last line logged at level error or critical, or the last line of a traceback (the exception);
    else the last line at all."""

    def __init__(self, pipe: IO[bytes], sink: int = 2):
        self.pipe = pipe
        self.sink = sink
        self.last_error = ""
        self.last_line = ""
        self._in_traceback = False
        self._thread = threading.Thread(target=self._pump, name="child-output", daemon=True)
        self._thread.start()

    def summary(self, timeout: float = 1.0) -> str:
        """The child's last error line, once what it wrote before exiting is read (up to ``timeout`` s)."""
        self._thread.join(timeout)
        return self.last_error or self.last_line

    def _pump(self) -> None:
        with self.pipe:
            for line in iter(self.pipe.readline, b""):
                try:
                    os.write(self.sink, line)  # one write a line: lines of several children do not mix
                except OSError:
                    pass  # our own stderr is gone: keep reading, so the child never blocks
                self._note(_ANSI.sub("", line.decode(errors="replace")).rstrip())

    def _note(self, text: str) -> None:
        if not text.strip():
            return
        self.last_line = text.strip()
        if text.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
        elif self._in_traceback and not text[0].isspace():
            self.last_error, self._in_traceback = text, False  # "ValueError: ...", the traceback's last line
        elif (error := _logged_error(text)) is not None:
            self.last_error = error


def _logged_error(text: str) -> str | None:
    """The message of a log line at level error or critical (JSON or console), else None."""
    if text.startswith("{"):
        try:
            event = json.loads(text)
        except ValueError:
            return None
        if not isinstance(event, dict) or event.get("level") not in ("error", "critical"):
            return None
        detail = event.get("error") or str(event.get("exception", "")).strip().rsplit("\n", 1)[-1]
        return f"{event.get('event', '')}: {detail}" if detail else str(event.get("event", ""))
    if _CONSOLE_ERROR.search(text) or _STDLIB_ERROR.match(text):
        return text.split(" ", 1)[1] if _CONSOLE_ERROR.search(text) else text  # without its timestamp
    return None
