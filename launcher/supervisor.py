"""Keeps ``epd up``'s processes running, and grows or shrinks a kind on request.

Each process runs in a slot (a kind, a replica number, its GPU). When a process ends:
- with status 0 (it was told to stop — SIGTERM from an operator scaling in, or from us — and drained):
  the slot is retired, the rest of the stack serves on;
- otherwise (killed, crashed): it is restarted in its slot after a back-off that doubles from
  ``first_backoff`` up to ``max_backoff``; a slot that crashes ``crash_limit`` times within ``window``
  seconds is given up, with a ``stack.crash_loop`` log line naming it.
Meanwhile the other processes keep serving (requests on a lost worker are resumed by the frontend).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

from launcher.stack import Stack
from launcher.topology import Placement
from shared.logging import get_logger

log = get_logger(__name__)


@dataclass
class Slot:
    placement: Placement
    replica: int
    args: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    crashes: deque = field(default_factory=deque)  # monotonic times of recent crashes
    restart_at: float | None = None
    retired: bool = False  # scaled in, or given up after a crash loop
    stopping: bool = False  # we sent it SIGTERM

    @property
    def kind(self) -> str:
        return self.placement.kind

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    def __init__(self, stack: Stack, first_backoff: float = 1.0, max_backoff: float = 30.0, crash_limit: int = 5,
                 window: float = 60.0):
        self.stack = stack
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.crash_limit = crash_limit
        self.window = window
        self.slots: list[Slot] = []
        self.restarts = 0

    def start(self, placement: Placement, replica: int, *args: str) -> Slot:
        slot = Slot(placement, replica, args)
        self.slots.append(slot)
        self._spawn(slot)
        return slot

    def live(self, kind: str) -> list[Slot]:
        """Slots of ``kind`` that run or will run again (not retired, not being stopped)."""
        return [s for s in self.slots if s.kind == kind and not s.retired and not s.stopping]

    def retire(self, slot: Slot) -> None:
        """Scale in: SIGTERM it (it drains, then exits 0)."""
        slot.stopping = True
        if slot.running:
            slot.process.send_signal(signal.SIGTERM)
        else:
            slot.retired = True

    def check(self, now: float | None = None) -> None:
        """Notice ended processes, restart what is due; call every fraction of a second."""
        now = time.monotonic() if now is None else now
        for slot in self.slots:
            if slot.retired:
                continue
            if slot.process is not None and slot.process.poll() is not None:
                self._ended(slot, now)
            elif slot.process is None and slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot)
                self.restarts += 1

    def _ended(self, slot: Slot, now: float) -> None:
        status, pid = slot.process.returncode, slot.process.pid
        self._forget(slot.process)
        slot.process = None
        if status == 0 or slot.stopping:
            slot.retired = True
            log.info("stack.worker_left", kind=slot.kind, pid=pid, status=status)
            return
        slot.crashes.append(now)
        while slot.crashes and now - slot.crashes[0] > self.window:
            slot.crashes.popleft()
        if len(slot.crashes) >= self.crash_limit:
            slot.retired = True
            log.error("stack.crash_loop", kind=slot.kind, replica=slot.replica, crashes=len(slot.crashes),
                      seconds=self.window, hint="not restarted again; the rest of the stack keeps serving")
            return
        delay = min(self.first_backoff * 2 ** (len(slot.crashes) - 1), self.max_backoff)
        slot.restart_at = now + delay
        log.warning("stack.worker_died", kind=slot.kind, pid=pid, status=status, restart_in=delay)

    def _spawn(self, slot: Slot) -> None:
        slot.restart_at = None
        slot.process = self.stack.spawn(slot.kind, *slot.args, env=slot.placement.env())

    def _forget(self, process: subprocess.Popen) -> None:
        self.stack.processes = [(k, p) for k, p in self.stack.processes if p is not process]
