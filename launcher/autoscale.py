"""``--encoders MIN:MAX``: the launcher grows the encoder tier while it stays busy and shrinks it once
it stays idle.

Load is the encode jobs in flight per live encoder, as the encoders themselves report it in the NATS
service API, sampled once a second. Its mean over the last ``up.SCALE_UP_AFTER_S`` seconds above
``--scale-up-load``: one more encoder (GPUs round-robin as at start). No job in flight in any sample
of the last ``--scale-down-after`` seconds: the newest encoder is sent SIGTERM (it leaves the queue
group, finishes its jobs and serves what it handed out, so scaling in loses nothing). One change at a
time; after each, the window starts again (hysteresis), and nothing is judged while an encoder is
still starting.
"""

from __future__ import annotations

from collections import deque

from launcher.supervisor import Supervisor
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
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, jobs in flight, encoders listed)
        self._since = 0.0  # start of the window being judged (the last change)

    def step(self, now: float) -> None:
        live = self.supervisor.live("encoder")
        listed = self.directory.of("encoder")
        if len(listed) < len(live):  # one is still starting: judge the tier once it is up
            self._restart(now)
            return
        self._samples.append((now, sum(int(e.data.get("in_flight", 0)) for e in listed), len(listed)))
        while self._samples and now - self._samples[0][0] > max(self.up_after, self.down_after):
            self._samples.popleft()
        if self._busy(now) and len(live) < self.scale.high:
            replica = max((s.replica for s in self.supervisor.slots if s.kind == "encoder"), default=-1) + 1
            self.supervisor.start(self.placement(replica), replica)
            log.info("stack.scaled_out", kind="encoder", encoders=len(live) + 1)
            self._restart(now)
        elif self._idle(now) and len(live) > self.scale.low:
            self.supervisor.retire(max(live, key=lambda s: s.replica))
            log.info("stack.scaled_in", kind="encoder", encoders=len(live) - 1)
            self._restart(now)

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
