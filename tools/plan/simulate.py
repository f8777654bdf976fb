"""A simulation of one replica, request by request, from the costs ``model.py`` reasons with: the reference
its closed forms are checked against (tests/test_bench.py), and a replay of a benchmark point's own
arrivals (``bench/plan_accuracy.py --replay``), which tells the model's error from the sample's: a point
of 8-40 requests is one draw of a Poisson process, its mean TTFT 10-40 % off the process's own.

It schedules as the code does, with the model's per-request costs (media m, ViT v, prefill P, decode
step t(B) and the rows a step carries):
- an engine step (``Scheduler``): every decoding sequence's row first, then prompt chunks (those that have
  waited longer than the priority window oldest first, the rest fewest tokens left first) until
  ``step_tokens``, and while sequences decode until the step's predicted time reaches ``target_itl_s``
  less the ViT gap before it (a block at least), unless the budget yields (a prompt has waited past
  ``BACKLOG_S``, or budgeted steps would delay the prompts' last first token by more than the target); a step
  with chunks takes their share of their prompts' prefill plus the rows, a decode-only step t(B);
- aggregated (``EngineLoop`` with ``VisionBatcher.step``): before a step, when images are queued, a
  gap: batches of what is queued (and arrives meanwhile) until none is, or ``STEP_BUDGET_S`` of ViT
  time is spent — while sequences decode, what ``target_itl_s`` leaves after their step, each forward
  cut to fit (one image at least), unless the budget yields or a queued image has waited past ``BACKLOG_S``. The
  prompts whose images a gap finished join the next step: encoded in place, they are in the engine by
  then. Two older ways are kept to replay the runs that had them: through the frontend
  (``handback="frontend"``), they miss the step that starts at once; with the removed hand-off
  (``"handoff"``), a decode-only step first, then they join;
- E/PD (an encoder beside a joined worker): the encoder forwards everything queued at a time, a
  request's images together (the sibling wait); a prompt reaches the worker after its embeddings'
  transfer. The processes slow each other by the model's solved factors (``Prediction.busy``).
Left out: the prompt's trip through the frontend (calibration carries it), KV room, ``max_num_seqs``.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

from tools.plan.layouts import Layout
from tools.plan.model import BLOCK_TOKENS, Planner, Traffic

# as the code has them (tests compare): services/encoder/batcher.py, vision.py and settings.py,
# shared/engine/scheduler.py; tools/plan stays without torch
STEP_BUDGET_S = 0.25
MAX_BATCH_IMAGES = 32
MAX_BATCH_PATCHES = 65536
MIX_PATCHES = 8192  # a GPU forward takes another request's images up to the graphs' patches (VisionBatcher._fits)
PRIORITY_WINDOW_S = 2.0
BACKLOG_S = PRIORITY_WINDOW_S  # a prompt (or a held image) this late: steps and gaps unpaced until none is
PATCHES_PER_TOKEN = 4  # a 2 × 2 merge: an image of k placeholder tokens is 4k patches


@dataclass(frozen=True)
class Arrival:
    at: float  # s from the start
    images: int
    output_len: int


def poisson(t: Traffic, seconds: float, seed: int = 0) -> list[Arrival]:
    """The traffic's requests over ``seconds``: Poisson arrivals, each class as likely as ``t`` says."""
    draw, now, out = random.Random(seed), 0.0, []
    kinds = t.classes()
    while (now := now + draw.expovariate(t.rate)) < seconds:
        out.append(Arrival(now, draw.choices([n for _, n in kinds], [p for p, _ in kinds])[0], t.output_len))
    return out


@dataclass(eq=False)
class _Request:
    arrival: Arrival
    tokens: int
    prefill_s: float
    left: int  # prompt tokens not computed yet
    rows: int  # tokens still to decode after the first
    images_left: int
    ready: float = math.inf  # its prompt in the engine from then on
    first_token: float = math.nan


@dataclass
class _Vision:
    """Images waiting for the ViT (oldest first) and the forwards that take them."""

    planner: Planner
    patches: int  # of one image
    slowdown: float = 1.0
    queue: list[tuple[float, _Request]] = field(default_factory=list)  # (queued at, request), by time

    def ready(self, now: float) -> bool:
        return bool(self.queue) and self.queue[0][0] <= now

    def forward(self, now: float, seconds: float = math.inf) -> tuple[float, list[_Request]]:
        """One batch of what is queued by ``now``, its forward within ``seconds`` (one image at least): the
        time it ends, the requests it finished."""
        taken: list[_Request] = []
        for queued, r in self.queue:  # a prefix: the queue is by time
            total = (len(taken) + 1) * self.patches
            alone = all(other is r for other in taken)  # one request's own images may pass MIX_PATCHES
            if queued > now or len(taken) == MAX_BATCH_IMAGES or (taken and total > MAX_BATCH_PATCHES) or (
                    taken and total > MIX_PATCHES and not alone) or (
                    taken and self.planner.vit(len(taken) + 1) * self.slowdown > seconds):
                break
            taken.append(r)
        del self.queue[:len(taken)]
        now += self.planner.vit(len(taken)) * self.slowdown
        for r in taken:
            r.images_left -= 1
        return now, [r for r in dict.fromkeys(taken) if r.images_left == 0]

    def gap(self, now: float, budget: float | None = None) -> tuple[float, list[_Request]]:
        """The aggregated engine thread's ViT between two steps: the requests whose images it finished.
        ``budget``: seconds the gap may take while sequences decode, each forward cut to what is left;
        None: up to ``STEP_BUDGET_S``, forwards as large as the limits allow."""
        deadline, finished = now + (STEP_BUDGET_S if budget is None else budget), []
        first = True
        while self.ready(now) and (now < deadline or first):
            now, done = self.forward(now, math.inf if budget is None else max(0.0, deadline - now))
            finished += done
            first = False
        return now, finished


class _Engine:
    """One engine: its waiting and running prompts, its decoding sequences, its steps."""

    def __init__(self, planner: Planner, t: Traffic, prefill_slowdown: float = 1.0, decode_slowdown: float = 1.0):
        self.planner, self.t = planner, t
        self.step_s = planner.step(t)
        self.slow_prefill, self.slow_decode = prefill_slowdown, decode_slowdown
        self.prompts: list[_Request] = []
        self.decoding: list[_Request] = []
        self.upstream = lambda now: 0  # prompt tokens in the ViT's queue (aggregated: ``Scheduler.upstream``)
        # a prompt token's prefill at the workload's mean (``Planner.prompt_room`` sizes budgeted steps by it)
        self.mean_token_s = t.mean(lambda n: planner.prefill(t, n)) / t.mean(
            lambda n: planner.costs.prompt_tokens(t.input_len, n)) * prefill_slowdown

    def has_work(self) -> bool:
        return bool(self.prompts or self.decoding)

    def yields(self, now: float) -> bool:
        """The time budget gives way to the prompts in the engine (``Scheduler.yields``): one has waited
        longer than ``BACKLOG_S``, or budgeted steps would delay the last of them by more than the target
        (each pays the rows' time, and takes fewer prompt tokens than the token budget)."""
        if any(now - r.ready > BACKLOG_S for r in self.prompts):
            return True
        queued = sum(r.left for r in self.prompts) + self.upstream(now)
        if not queued or not self.decoding or not self.planner.target_itl_s:
            return False
        rows = len(self.decoding)
        rows_s = self.planner.decode_rows(self.t, rows) * self.slow_decode
        token_s = self._token_s(self.prompts[0]) if self.prompts else self.mean_token_s
        full = max(self.planner.step_tokens - rows, BLOCK_TOKENS)
        return self.planner.yields(rows_s, queued, self.planner.prompt_room(rows, rows_s, token_s), full)

    def gap_budget(self, now: float) -> float | None:
        """What the time target leaves the ViT before the next step while sequences decode
        (``Scheduler.gap_budget_s``); None: nothing decodes, no target, or the budget yields."""
        if not self.decoding or not self.planner.target_itl_s or self.yields(now):
            return None
        return max(0.0, self.planner.target_itl_s - self.step_s(len(self.decoding)) * self.slow_decode)

    def step(self, now: float, decode_only: bool = False, gap: float = 0.0) -> float:
        """``gap``: seconds the ViT took right before it (the decode rows waited for it too)."""
        rows = len(self.decoding)
        rows_s = self.planner.decode_rows(self.t, rows) * self.slow_decode
        paced = rows and self.planner.target_itl_s and not self.yields(now)
        seconds = self.planner.target_itl_s - gap - rows_s if paced else math.inf
        chunks = [] if decode_only else self._chunks(now, self.planner.step_tokens - rows, seconds)
        if chunks:
            now += sum(self._token_s(r) * take for r, take in chunks) + rows_s
        elif rows:
            now += self.step_s(rows) * self.slow_decode
        else:
            return now
        for r in list(self.decoding):
            r.rows -= 1
            if r.rows <= 0:
                self.decoding.remove(r)
        for r, take in chunks:
            r.left -= take
            if not r.left:
                r.first_token = now
                self.prompts.remove(r)
                if r.rows > 0:
                    self.decoding.append(r)
        return now

    def _token_s(self, r: _Request) -> float:
        return r.prefill_s * self.slow_prefill / r.tokens

    def _chunks(self, now: float, budget: int, seconds: float = math.inf) -> list[tuple[_Request, int]]:
        overdue = sorted((r for r in self.prompts if now - r.ready > PRIORITY_WINDOW_S), key=lambda r: r.ready)
        fresh = sorted((r for r in self.prompts if now - r.ready <= PRIORITY_WINDOW_S), key=lambda r: r.left)
        floor = BLOCK_TOKENS if math.isfinite(seconds) else 0
        out = []
        for r in overdue + fresh:
            take = min(budget, r.left)
            if math.isfinite(seconds):
                take = max(min(take, int(max(0.0, seconds) / self._token_s(r))), min(take, floor))
            if take <= 0:
                break
            out.append((r, take))
            budget, floor, seconds = budget - take, floor - take, seconds - take * self._token_s(r)
            if take < r.left:
                break
        return out


def simulate(planner: Planner, layout: Layout, t: Traffic, arrivals: list[Arrival],
             handback: str = "in_place") -> list[float]:
    """Each arrival's TTFT (s, without the stack's fixed costs) on one replica of ``layout``: aggregated,
    or an encoder beside a joined language worker (``t`` sets the decode context and the slowdowns);
    ``handback``: how the aggregated worker's encoded prompts reach its engine (the module docstring)."""
    if handback not in ("in_place", "frontend", "handoff"):
        raise ValueError(f"simulate: unknown handback {handback!r}")
    if layout.topology == "aggregated" and layout.gpus == 1:
        requests = _requests(planner, t, arrivals)
        vision = _Vision(planner, planner.costs.image_tokens * PATCHES_PER_TOKEN)
        vision.queue = sorted(((r.arrival.at + planner.media(r.arrival.images), r) for r in requests
                               for _ in range(r.arrival.images)), key=lambda item: item[0])
        engine = _Engine(planner, t)
        engine.upstream = lambda now: planner.costs.image_tokens * bisect.bisect_right(
            vision.queue, now, key=lambda item: item[0])  # the images queued by now
        _run(engine, requests, vision, handback)
    elif layout.pd == "joined" and layout.lm_gpus == 1 and layout.encoders == 1:
        busy = planner.predict(layout, t).busy
        requests = _requests(planner, t, arrivals)
        _encode(planner, requests, busy.get("slowdown_vit", 1.0))
        _run(_Engine(planner, t, busy.get("slowdown_prefill", 1.0), busy.get("slowdown_decode", 1.0)), requests)
    else:
        raise ValueError(f"simulate: {layout.label()} is neither one aggregated process nor one encoder and one "
                         "joined worker")
    return [r.first_token - r.arrival.at for r in requests]


def _requests(planner: Planner, t: Traffic, arrivals: list[Arrival]) -> list[_Request]:
    out = []
    for a in arrivals:
        tokens = planner.costs.prompt_tokens(t.input_len, a.images)
        out.append(_Request(a, tokens, planner.prefill(t, a.images), tokens, a.output_len - 1, a.images,
                            math.inf if a.images else a.at))
    return out


def _encode(planner: Planner, requests: list[_Request], slowdown: float) -> None:
    """An encoder process of its own: forwards back to back while images are queued."""
    vision = _Vision(planner, planner.costs.image_tokens * PATCHES_PER_TOKEN, slowdown)
    vision.queue = sorted(((r.arrival.at + planner.media(r.arrival.images), r) for r in requests
                           for _ in range(r.arrival.images)), key=lambda item: item[0])
    now = 0.0
    while vision.queue:
        now, done = vision.forward(max(now, vision.queue[0][0]))
        for r in done:
            r.ready = now + planner.transfer(r.arrival.images)


def _run(engine: _Engine, requests: list[_Request], vision: _Vision | None = None, handback: str = "in_place") -> None:
    """The engine thread: commands (prompts that arrived), the ViT gap when images wait, a step."""
    pending = sorted((r for r in requests if math.isfinite(r.ready)), key=lambda r: r.ready)
    now = 0.0
    while pending or engine.has_work() or (vision and vision.queue):
        while pending and pending[0].ready <= now:
            engine.prompts.append(pending.pop(0))
        gap = 0.0
        if vision and vision.ready(now):
            began = now
            late = now - vision.queue[0][0] > BACKLOG_S  # an image a cut held back (``VisionBatcher.waited_s``)
            now, finished = vision.gap(now, None if late else engine.gap_budget(now))
            gap = now - began
            for r in finished:
                r.ready = now
            # through the frontend the prompts miss the step that starts at once; the hand-off waited for
            # them only when no image was left queued (whose they are is not known there)
            if finished and engine.has_work() and handback != "in_place":
                now = engine.step(now, decode_only=handback == "handoff" and not vision.ready(now))
            engine.prompts += finished
        if engine.has_work():
            now = engine.step(now, gap=gap)
            continue
        upcoming = [pending[0].ready] if pending else []
        if vision and vision.queue:
            upcoming.append(vision.queue[0][0])
        now = max(now, min(upcoming, default=now))
