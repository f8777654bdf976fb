"""The workers a request needs, named as its stack names them, and the wait for one to be listed.

A frontend is not told its stack's layout: it reads it from the directory. Every request needs an
intake worker (``language`` in E/PD, ``prefill`` in E/P/D, ``aggregated``); a prompt sent to a prefill
worker also needs a ``decode`` worker; images and videos need an ``encoder`` (or an aggregated worker).
The kinds listed since the frontend started say which layout this is, so a missing worker is named in
its stack's own terms ("no language worker is available", not "no prefill worker" in an E/PD stack).

A request that finds no worker of a kind it needs listed (one restarting, a tier scaling up from zero, a
frontend started before its workers) waits for the listing to show one, up to ``--worker-wait`` seconds
in all. The listing only wakes it: whether anybody serves is NATS's to say (a worker too busy to answer
the listing in time still takes work), so the request then goes on, and only "no responders" is a 503,
which names the kind. How many requests wait for each kind is in the frontend's stats, so a launcher can
scale a tier up from zero (``waiting_encoder``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import contextmanager

from services.frontend.routing import ENCODER_KINDS, INTAKE_KINDS
from shared.bus.directory import Directory

_INTAKE_NAMES = {"aggregated": "aggregated worker", "prefill": "prefill worker", "language": "language worker"}


class StackWorkers:
    def __init__(self, directory: Directory, wait: float, media: bool):
        self.directory = directory
        self.wait = wait  # seconds a request waits for a kind it needs
        self.media = media  # this frontend takes images and videos (False: the stack serves text only)
        self.waiting: Counter[str] = Counter()  # requests waiting now, by what they wait for

    # -- names ------------------------------------------------------------------------------------
    def intake_name(self) -> str:
        """The stack's own word for its intake workers, from the kinds it has listed."""
        seen = self.directory.seen | ({"prefill"} if "decode" in self.directory.seen else set())
        names = [_INTAKE_NAMES[k] for k in ("aggregated", "prefill", "language") if k in seen]
        if not names:
            return "language-model worker (language, prefill or aggregated)"
        return " or ".join(n.removesuffix(" worker") for n in names[:-1]) + (" or " if names[1:] else "") + names[-1]

    def missing(self) -> str | None:
        """What this stack lacks to serve every request this frontend accepts (None: nothing)."""
        if not self.directory.refreshed.is_set():
            return "the stack's workers have not been listed yet"
        if (need := self.missing_for_text()) is not None:
            return need
        if self.media and not self.directory.of(*ENCODER_KINDS):
            return "no encoder is available"
        return None

    def missing_for_text(self) -> str | None:
        intake = self.directory.of(*INTAKE_KINDS)
        if not intake:
            return f"no {self.intake_name()} is available"
        if all(w.kind == "prefill" for w in intake) and not self.directory.of("decode"):
            return "no decode worker is available"
        return None

    # -- waiting ----------------------------------------------------------------------------------
    def deadline(self) -> float:
        """When a request that starts waiting now stops waiting (event-loop time)."""
        return asyncio.get_running_loop().time() + self.wait

    async def intake(self, until: float, exclude: set[str] = frozenset()) -> bool:
        """Whether an intake worker not in ``exclude`` is listed, waiting for one until ``until``."""
        return await self._need("intake", INTAKE_KINDS, until, lambda w: w.instance not in exclude)

    async def decode(self, until: float) -> bool:
        """Whether a decode worker is listed (a prefill worker hands every prompt on to one)."""
        return await self._need("decode", ("decode",), until)

    async def encoder(self, until: float, exclude: set[str] = frozenset()) -> bool:
        """Whether an encoder not in ``exclude`` is listed."""
        return await self._need("encoder", ENCODER_KINDS, until, lambda e: e.instance not in exclude)

    async def _need(self, what: str, kinds: tuple[str, ...], until: float, accept=lambda _: True) -> bool:
        if any(accept(i) for i in self.directory.of(*kinds)):
            return True
        with self._waiting(what):
            left = until - asyncio.get_running_loop().time()
            return bool(await self.directory.wait_for(kinds, max(0.0, left), accept))

    @contextmanager
    def _waiting(self, what: str):
        self.waiting[what] += 1
        try:
            yield
        finally:
            self.waiting[what] -= 1

    def stats(self) -> dict[str, int]:
        return {f"waiting_{what}": self.waiting[what] for what in ("intake", "decode", "encoder")}
