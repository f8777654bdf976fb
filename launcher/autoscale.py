"""``--encoders MIN:MAX``: the launcher grows the encoder tier while it stays busy and shrinks it once
it stays idle.

Load is the encode jobs in flight per live encoder, as the encoders themselves report it in the NATS
service API. Over ``--scale-up-load`` for ``--scale-up-after`` seconds: one more encoder (GPUs
round-robin as at start). No job in flight for ``--scale-down-after`` seconds: the newest encoder is
sent SIGTERM (it leaves the queue group, finishes its jobs and serves what it handed out, so scaling in
loses nothing). One change at a time; after each, the clocks start again (hysteresis).
"""

from __future__ import annotations

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
        self._busy_since: float | None = None
        self._idle_since: float | None = None

    def step(self, now: float) -> None:
        live = self.supervisor.live("encoder")
        listed = self.directory.of("encoder")
        if len(listed) < len(live):
            self._busy_since = self._idle_since = None  # one is still starting: judge the tier once it is up
            return
        in_flight = sum(int(e.data.get("in_flight", 0)) for e in listed)
        load = in_flight / max(len(listed), 1)
        self._busy_since = (self._busy_since or now) if load > self.up_load else None
        self._idle_since = (self._idle_since or now) if in_flight == 0 else None
        if self._busy_since is not None and now - self._busy_since >= self.up_after and len(live) < self.scale.high:
            replica = max((s.replica for s in self.supervisor.slots if s.kind == "encoder"), default=-1) + 1
            self.supervisor.start(self.placement(replica), replica)
            log.info("stack.scaled_out", kind="encoder", encoders=len(live) + 1, load=round(load, 2))
            self._busy_since = None
        elif self._idle_since is not None and now - self._idle_since >= self.down_after and len(live) > self.scale.low:
            newest = max(live, key=lambda s: s.replica)
            self.supervisor.retire(newest)
            log.info("stack.scaled_in", kind="encoder", encoders=len(live) - 1)
            self._idle_since = None
