"""``--encoders MIN:MAX``: the launcher grows the encoder tier while it stays busy and shrinks it once
it stays idle, never leaving it without a ready encoder it could keep.

Load is the encode jobs in flight per listed encoder, as the encoders themselves report it in the NATS
service API, plus the requests the frontends report waiting for an encoder, sampled once a second. Its
mean over the last ``up.SCALE_UP_AFTER_S`` seconds above ``--scale-up-load``: one more encoder (GPUs
round-robin as at start); a tier at zero grows as soon as a request waits for it. No job in flight and
none waiting in any sample of the last ``--scale-down-after`` seconds: one encoder is sent SIGTERM — one
still starting if there is one (it serves nothing yet), else the newest ready one (it leaves the queue
group, finishes its jobs and serves what it handed out, so scaling in loses nothing). One change at a
time; after each, the window starts again (hysteresis); no growth is judged while an encoder is still
starting. One that cannot start is the supervisor's (reported, killed and started again).
"""

from __future__ import annotations

from collections import deque

from launcher.supervisor import Slot, Supervisor
from launcher.topology import EncoderScale
from shared.bus.directory import Directory
from shared.logging import get_logger

log = get_logger(__name__)


class EncoderAutoscaler:
    def __init__(self, supervisor: Supervisor, directory: Directory, scale: EncoderScale, placement,
                 up_load: float, up_after: float, down_after: float):
        self.supervisor = supervisor
        self.directory = directory
        self.scale = scale
        self.placement = placement  # replica number → Placement
        self.up_load = up_load
        self.up_after = up_after
        self.down_after = down_after
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, jobs in flight + waiting, encoders listed)
        self._since = 0.0  # start of the window being judged (the last change)

    def step(self, now: float) -> None:
        live = self.supervisor.live("encoder")
        listed = self.directory.of("encoder")
        waiting = sum(int(f.data.get("waiting_encoder", 0)) for f in self.directory.of("frontend"))
        jobs = sum(int(e.data.get("in_flight", 0)) for e in listed) + waiting
        self._samples.append((now, jobs, len(listed)))
        while self._samples and now - self._samples[0][0] > max(self.up_after, self.down_after):
            self._samples.popleft()
        starting = [s for s in live if not s.ready]
        if len(live) < self.scale.high and (not live and waiting or not starting and self._busy(now)):
            replica = max((s.replica for s in self.supervisor.slots if s.kind == "encoder"), default=-1) + 1
            self.supervisor.start(self.placement(replica), replica)
            log.info("stack.scaled_out", kind="encoder", encoders=len(live) + 1, waiting=waiting)
            self._restart(now)
        elif self._idle(now) and len(live) > self.scale.low:
            leaving = self._leaving(live)
            self.supervisor.retire(leaving)
            log.info("stack.scaled_in", kind="encoder", encoders=len(live) - 1, replica=leaving.replica,
                     ready=leaving.ready)
            self._restart(now)

    @staticmethod
    def _leaving(live: list[Slot]) -> Slot:
        """Which encoder goes: a starting one before a ready one, the newest first."""
        return max(live, key=lambda s: (not s.ready, s.replica))

    def _busy(self, now: float) -> bool:
        recent = [(jobs, n) for t, jobs, n in self._samples if now - t <= self.up_after]
        if now - self._since < self.up_after or not recent:
            return False
        return sum(jobs / max(n, 1) for jobs, n in recent) / len(recent) > self.up_load

    def _idle(self, now: float) -> bool:
        recent = [jobs for t, jobs, _ in self._samples if now - t <= self.down_after]
        return now - self._since >= self.down_after and bool(recent) and not any(recent)

    def _restart(self, now: float) -> None:
        self._samples.clear()
        self._since = now
