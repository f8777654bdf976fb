"""Keeps ``epd up``'s processes running, from their start on, and grows or shrinks a kind on request.

Each process runs in a slot (a kind, a replica number, its GPU). A slot is *ready* once the NATS
service API lists its process (a service registers only when it can serve). When a process ends:
- with status 0 (it was told to stop — SIGTERM from an operator scaling in, or from us — and drained):
  the slot is retired, the rest of the stack serves on;
- otherwise (killed, crashed): it is restarted in its slot after a back-off that doubles from
  ``first_backoff`` up to ``max_backoff``.
A process that is not ready ``start_timeout`` seconds after it started (stuck loading, waiting on a GPU)
is reported (``stack.start_timeout``), killed, and restarted like a crash.

Crash loops. While the stack starts (``serving`` not yet set), a slot that fails ``start_attempts`` times
in a row stops the stack (``StartFailed``) with the process's own last error line: nothing serves yet,
and a worker that cannot start three times will not start the fourth (a bad model path, too little GPU
memory) — its user must change something. Once the stack serves, a crash loop (``crash_limit`` crashes
within ``window`` seconds) is logged with that line (``stack.crash_loop``) and the slot keeps being
restarted every ``max_backoff`` seconds: a serving stack heals when the cause passes (a GPU freed, a
request that crashed a worker gone), its other kinds keep serving, and a request for the missing kind
waits for it, then gets a 503 that names it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

from launcher.stack import Stack, exit_status
from launcher.topology import Placement
from shared.logging import get_logger

log = get_logger(__name__)


class StartFailed(RuntimeError):
    """A worker crash-looped before the stack was ready."""


@dataclass
class Slot:
    placement: Placement
    replica: int
    args: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    crashes: deque = field(default_factory=deque)  # monotonic times of recent crashes
    failed_starts: int = 0  # crashes in a row before the process became ready
    last_error: str = ""  # the last crashed process's own last error line
    started_at: float = 0.0
    ready: bool = False  # its process is listed (since it last started)
    restart_at: float | None = None
    retired: bool = False  # scaled in
    stopping: bool = False  # we sent it SIGTERM

    @property
    def kind(self) -> str:
        return self.placement.kind

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    def __init__(self, stack: Stack, first_backoff: float = 1.0, max_backoff: float = 30.0, crash_limit: int = 5,
                 window: float = 60.0, start_attempts: int = 3, start_timeout: float = 300.0):
        self.stack = stack
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.crash_limit = crash_limit
        self.window = window
        self.start_attempts = start_attempts
        self.start_timeout = start_timeout
        self.slots: list[Slot] = []
        self.restarts = 0
        self.serving = False  # the stack is ready: a crash loop no longer stops it

    def start(self, placement: Placement, replica: int, *args: str) -> Slot:
        slot = Slot(placement, replica, args)
        self.slots.append(slot)
        self._spawn(slot, time.monotonic())
        return slot

    def live(self, kind: str) -> list[Slot]:
        """Slots of ``kind`` that run or will run again (not retired, not being stopped)."""
        return [s for s in self.slots if s.kind == kind and not s.retired and not s.stopping]

    def retire(self, slot: Slot) -> None:
        """Scale in: SIGTERM it (it drains, or stops starting, then exits 0)."""
        slot.stopping = True
        if slot.running:
            slot.process.send_signal(signal.SIGTERM)
        else:
            slot.retired = True

    def check(self, now: float | None = None, listed: set[int] | None = None) -> None:
        """Notice listed, ended and stuck processes, restart what is due; call every fraction of a second.
        ``listed``: pids the NATS service API lists now (None: not known this time)."""
        now = time.monotonic() if now is None else now
        for slot in self.slots:
            if slot.retired:
                continue
            if slot.running and listed is not None and slot.process.pid in listed:
                slot.ready, slot.failed_starts = True, 0
            if slot.process is not None and slot.process.poll() is not None:
                self._ended(slot, now)
            elif slot.running and not slot.ready and not slot.stopping and now - slot.started_at > self.start_timeout:
                log.error("stack.start_timeout", kind=slot.kind, replica=slot.replica, pid=slot.process.pid,
                          seconds=self.start_timeout, hint="not ready in time: killed and started again")
                slot.process.kill()  # never listed, so it holds no work; the next check restarts it
            elif slot.process is None and slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot, now)
                self.restarts += 1

    def _ended(self, slot: Slot, now: float) -> None:
        process = slot.process
        status, pid = process.returncode, process.pid
        slot.process = None
        if status == 0 or slot.stopping:
            self.stack.forget(process)
            slot.retired = True
            log.info("stack.worker_left", kind=slot.kind, pid=pid, status=status)
            return
        words = slot.last_error = self.stack.last_words(process)
        self.stack.forget(process)
        slot.failed_starts += not slot.ready
        if not self.serving and slot.failed_starts >= self.start_attempts:
            raise StartFailed(f"the {slot.kind} process failed {slot.failed_starts} times while starting "
                              f"({exit_status(status)}); its last error: {words}")
        slot.crashes.append(now)
        while slot.crashes and now - slot.crashes[0] > self.window:
            slot.crashes.popleft()
        delay = min(self.first_backoff * 2 ** (len(slot.crashes) - 1), self.max_backoff)
        slot.restart_at = now + delay
        if len(slot.crashes) >= self.crash_limit:
            log.error("stack.crash_loop", kind=slot.kind, replica=slot.replica, crashes=len(slot.crashes),
                      seconds=self.window, last_error=words, restart_in=delay)
        else:
            log.warning("stack.worker_died", kind=slot.kind, pid=pid, status=status, last_error=words,
                        restart_in=delay)

    def _spawn(self, slot: Slot, now: float) -> None:
        slot.restart_at, slot.ready, slot.started_at = None, False, now
        slot.process = self.stack.spawn(slot.kind, *slot.args, env=slot.placement.env())
