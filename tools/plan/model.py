"""The latency model of ``epd plan``: mean TTFT and TPOT of a layout at a request rate, from measured costs.

Every time in seconds; λ requests/s per replica; a request carries n images (0: text) with probability
p_n; L output tokens. Per request: media m(n) (the frontend decoding its images, ``MEDIA_THREADS`` at
a time), ViT v(n) (one forward over its n images, preprocessing on the device included), prefill P(n)
(its prompt), transfer x(n) (its embeddings over the data plane, not in aggregated). A decode step of
B sequences costs t(B) = a + b·x(B) + c·B·ctx, x(B) = B for a dense model and the experts B tokens touch
in a layer for a mixture of experts (``cost_table.py``); B follows from Little's law, B = λ·L·TPOT.

Queues (Poisson arrivals, ``queueing.py``): a server whose service time varies with n is M/G/1,
W = λ·E[S²] / 2(1 − ρ). Layouts:
- aggregated: one engine thread is one server. Between two engine steps it runs a ViT batch of the
  images waiting, then a step of the running batch's decode rows and C prompt tokens at most, prompt
  chunks shortest remaining first: C is what ``step_tokens`` leaves after the rows and, with a time
  target, what ``target_itl_s`` leaves after them at the workload's mean prefill time a token, unless the
  budget yields to the prompt tokens in the thread (a class's own and, by Little's law, those of the
  requests in the thread meanwhile; ``Planner.yields``). A request is followed from its images'
  arrival to its first token, each request class n on its own (P'_n: its prompt's steps, each with the
  decode rows in it; c_n its last step). What goes before it: every ViT batch and every prompt no
  longer than P'_n, b_m = v_m + P'_m·[P'_m ≤ P'_n], of load ρ_b; what cuts in at step boundaries once
  it waits: later ViT batches and shorter prompts, of load ρ_c. With R_n the residual of a step of a
  longer prompt or a pure decode step in progress (α_D·t/2), the work found ahead (the mean work of
  higher priority in a priority M/G/1) is A_n = (λ·E[b²]/2 + R_n) / (1 − ρ_b), and
  TTFT_n = m + (A_n + v_n + P'_n − c_n) / (1 − ρ_c) + c_n + F_n: a step is never interrupted, and
  F_n is the longer prompts its last step carries up to C (prompts waiting by Little's law, their
  number geometric, E[min(room, waiting)]). The encode stage is W_V + v with the ViT's own wait
  W_V = (λ·E[v²]/2 + R) / (1 − ρ_V), R the residual of any step. TPOT = t(B) / (1 − ρ_V − ρ_P).
  Checked against ``simulate.py`` (the engine thread's scheduling, request by request, from the same
  costs; 3,000 s of Poisson traffic): 0.87-1.05× its mean TTFT, 5 % off on average, over the bench's six
  workloads at 25-75 % of capacity on three measured floors (Qwen2.5-VL-7B, Qwen3-VL-30B-A3B); the
  two-class Cobham form it replaced (ViT, text prompts, image prompts, a text step filled with an
  image chunk) 0.67-0.99×, 13 % off, lower the higher the load. Not modelled: a prompt that has waited
  longer than the priority window (2 s) going first, which beyond ~65 % load raises image-heavy's mean.
- joined language worker (E/PD, colocated or disaggregated): the encoder is a server of its own
  (M/G/1 over requests' image sets, a request's images split over the encoders it may use); prefill
  queues M/G/1 ahead of decode in its engine: TTFT = m + W_E + v + W_P + α_D·t/2 + P + x;
  TPOT = t(B) / (1 − ρ_P). Against ``simulate.py`` (one encoder beside one joined worker, slowed by the
  factors solved here), as above: 0.86-1.05×, 3 % off on average.
- split (E/P/D): prefill workers queue M/G/1 with no decode step in the way; decode runs alone in its
  process: TTFT = m + W_E + v + W_P + P + x; TPOT = t(B).
Sharing a GPU: processes on one GPU slow each other. A stage x runs s_x = 1 + Σ_y α_y·(k[x|y] − 1)
times slower, over the activities y of the *other* processes on its GPU, α_y the share of time y keeps
the GPU busy (ViT and prefill: their utilisation, already slowed; decode: the share of time a sequence is
running, 1 − e^−B, less the joined engine's prefill share), solved as a fixed point with B. k[x|y]:
- with MPS, from ``costs.py``'s measurement (a ViT forward and decode steps, a ViT forward and a prefill,
  on two CUDA streams at once against alone): the pair's combined rate 1/k[x|y] + 1/k[y|x] shared
  equally, k = 2 / (1/k[x|y] + 1/k[y|x]) both ways (how two streams of one process split the GPU
  swings with launch order; what they get done together holds); prefill beside decode is taken as the
  ViT beside decode (both are compute-bound GEMM streams next to a bandwidth-bound one);
- time-sliced (no MPS), measured in ``timeslice.py`` the same way with the ViT in a second process
  (prefill beside decode taken as above); without that measurement, a model: both busy means each gets
  the GPU half the time, plus the switch between contexts: k = ``TIMESLICE`` for every pair.
Stages in one process never overlap on the GPU (the aggregated engine thread, a joined worker's engine).

Calibration: a stack also pays fixed costs no in-process measurement sees (encode jobs, pulls, replies,
NATS hops). Given ``Overheads`` (measured unloaded TTFT minus this model's TTFT at no load, per request
class), each request's TTFT is raised by its class's overhead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.plan.cost_table import Costs
from tools.plan.layouts import Layout
from tools.plan.queueing import mg1_wait
from tools.bench.settings import Workload
from shared.engine.settings import DEFAULT_TARGET_ITL_MS, GPU_STEP_TOKENS

TIMESLICE = 2.1  # slowdown of a stage while another process keeps a time-sliced GPU busy (model, not measured)
MPS_UNMEASURED = 1.5  # k under MPS when the costs carry no co-run measurement (plans written before them)
BLOCK_TOKENS = 16  # prompt tokens a step with decode rows takes whatever its time (the engine's block size)


@dataclass
class Traffic:
    """The workload as the model sees it, at one rate."""

    rate: float
    image_share: float
    counts: list[int]  # image counts of image requests, equally likely
    input_len: int
    output_len: int

    @property
    def mean_images(self) -> float:
        return sum(self.counts) / len(self.counts) if self.counts else 0.0

    def classes(self) -> list[tuple[float, int]]:
        """(probability, images) of every request kind."""
        text = [(1 - self.image_share, 0)] if self.image_share < 1 else []
        return text + [(self.image_share / len(self.counts), n) for n in self.counts if self.image_share > 0]

    def mean(self, fn: Callable[[int], float]) -> float:
        return sum(p * fn(n) for p, n in self.classes())


def traffic(workload: Workload, rate: float) -> Traffic:
    counts = [n for n in workload.image_counts() if n > 0]
    share = 0.0 if not counts else 1 - workload.text_ratio
    return Traffic(rate, share, counts, workload.input_len, workload.output_len)


@dataclass
class Prediction:
    layout: str
    topology: str
    encoders: int
    rate: float
    ttft_ms: float
    tpot_ms: float
    stable: bool
    ttft_by_images_ms: dict[int, float] = field(default_factory=dict)  # per request class (0: text)
    stages_ms: dict[str, float] = field(default_factory=dict)  # the frontend's stages: media, encode, first_token
    busy: dict[str, float] = field(default_factory=dict)  # share of time each stage keeps its GPU busy


Overheads = Callable[[int], float]  # images → seconds a stack adds to a request's TTFT


def decode_batch(rate: float, length: int, step: Callable[[float], float], slowdown: float = 1.0,
                 max_batch: float = math.inf) -> tuple[float, float]:
    """(B, TPOT s) with B = rate·L·TPOT and TPOT = step(B)·slowdown; (inf, inf) when decode cannot keep
    up (or would need more than ``max_batch`` sequences running)."""
    batch = 0.0
    for _ in range(200):  # fixed point; step() is increasing in B (affine; concave for MoE)
        tpot = step(batch) * slowdown
        nxt = rate * length * tpot
        if nxt > min(1e6, max_batch):
            return math.inf, math.inf
        if abs(nxt - batch) < 1e-6:
            break
        batch = nxt
    tpot = step(batch) * slowdown
    return (batch, tpot) if rate * length * tpot <= batch * 1.01 + 1e-9 else (math.inf, math.inf)


def decode_busy(batch: float) -> float:
    """Share of time at least one sequence is decoding: running sequences are Poisson (M/G/∞) of mean B."""
    return 1 - math.exp(-batch)


def expected_fill(room: float, waiting: float) -> float:
    """E[min(room, N)] prompts for N waiting prompts, geometric of mean ``waiting`` (a queue's length:
    P(N ≥ k) = r^k, r = waiting / (1 + waiting)); ``room`` in prompts, fractional."""
    r = waiting / (1 + waiting)
    whole = int(room)
    return sum(r ** k for k in range(1, whole + 1)) + (room - whole) * r ** (whole + 1)


@dataclass
class EngineThread:
    """The aggregated process's engine thread as the model follows a request through it (seconds).

    A request of class n (its images) is followed from its images' arrival to its first token: the work
    found there that goes first (every queued ViT batch, every prompt no longer than its own, the step in
    progress), its own ViT and prompt steps, the work of later arrivals that cuts in at step boundaries
    (their ViT batches, shorter prompts), then the longer prompts its last step carries."""

    rate: float
    classes: list[tuple[float, int]]  # (probability, images)
    vit: dict[int, float]  # a class's ViT
    steps: dict[int, list[float]]  # a class's prompt steps, the decode rows in each
    pure_decode: float  # the residual of a pure decode step at a random instant: α_D·t/2

    def load(self, work: Callable[[int], float]) -> float:
        return self.rate * sum(p * work(n) for p, n in self.classes)

    def own(self, n: int) -> float:
        return sum(self.steps[n])

    def residual(self, n: int) -> float:
        """E[remaining]·P(running) of a class's steps, per arrival of the class (Σ step² / 2)."""
        return sum(c ** 2 for c in self.steps[n]) / 2

    def vit_wait(self) -> float:
        """An image batch waits for the step in progress and the image batches queued before it."""
        rho = self.load(lambda n: self.vit[n])
        return (self.load(lambda n: self.vit[n] ** 2 / 2 + self.residual(n)) + self.pure_decode) / (1 - rho)

    def stages(self) -> dict[int, tuple[float, float]]:
        """{class: (encode, to first token)} before its last step is filled."""
        wait_vit = self.vit_wait()
        out = {}
        for _, n in self.classes:
            x = self.own(n)
            before = lambda m: self.vit[m] + (self.own(m) if self.own(m) <= x else 0.0)  # noqa: E731,B023
            cutting = lambda m: self.vit[m] + (self.own(m) if self.own(m) < x else 0.0)  # noqa: E731,B023
            longer = self.load(lambda m: self.residual(m) if self.own(m) > x else 0.0) + self.pure_decode  # noqa: B023
            ahead = (self.load(lambda m: before(m) ** 2) / 2 + longer) / (1 - self.load(before))
            last = self.steps[n][-1]  # a step is never interrupted
            done = (ahead + self.vit[n] + x - last) / (1 - self.load(cutting)) + last
            encode = wait_vit + self.vit[n] if n else 0.0
            out[n] = (encode, max(x, done - encode))
        return out

    def filled(self, stages: dict[int, tuple[float, float]], tokens: dict[int, int], rooms: dict[int, float],
               rounds: int = 5) -> dict[int, tuple[float, float]]:
        """A prompt's last step also carries the longer prompts waiting behind it, up to ``rooms[n]``
        tokens: its first token comes after their chunks too. Prompts waiting by Little's law (a class's
        time to first token beyond its own steps), their number geometric (a queue's length), the step
        holding E[min(room, waiting)] of them; iterated, since a fuller step lengthens the waits."""
        out = stages
        for _ in range(rounds):
            queued = {n: self.rate * p * max(0.0, out[n][1] - self.own(n)) for p, n in self.classes}
            out = {n: (stages[n][0], stages[n][1] + self._fill(n, queued, tokens, rooms[n])) for _, n in self.classes}
        return out

    def _fill(self, n: int, queued: dict[int, float], tokens: dict[int, int], room: float) -> float:
        # waiting behind it: longer prompts queued, and the longer prompt whose ViT batch is in progress
        # when it arrives (that batch ends right before its step, and hands its prompt straight to it)
        behind = [m for _, m in self.classes if self.own(m) >= self.own(n)]
        queued = {m: queued[m] + (self.rate * p * self.vit[m] if self.own(m) > self.own(n) else 0.0)
                  for p, m in self.classes}
        count = sum(queued[m] for m in behind)
        waiting_tokens = sum(queued[m] * tokens[m] for m in behind)
        if count <= 0 or room <= 0:
            return 0.0
        per_token = sum(queued[m] * self.own(m) for m in behind) / waiting_tokens
        per_prompt = waiting_tokens / count
        return expected_fill(room / per_prompt, count) * per_prompt * per_token


# Data-plane bandwidth between two processes of one GPU (docs/benchmarks.md): UCX GPU to GPU (cuda_ipc),
# ZMQ through host memory; what the planner charges for moving a request's embeddings.
DATA_PLANE_GBS = {"ucx": 20.0, "zmq": 1.7}


class Planner:
    def __init__(self, costs: Costs, data_plane_gbs: float = DATA_PLANE_GBS["zmq"], hidden_bytes: int = 0,
                 max_batch: int = 256, step_tokens: int = GPU_STEP_TOKENS,
                 target_itl_s: float = DEFAULT_TARGET_ITL_MS / 1e3):
        self.costs = costs
        self.step_tokens = step_tokens  # tokens an engine step computes at most (--max-batched-tokens)
        self.target_itl_s = target_itl_s  # seconds a step that carries decode rows may take (--target-itl-ms)
        self.bandwidth = data_plane_gbs * 1e9
        self.hidden_bytes = hidden_bytes  # bytes of one token's embedding (for the E→P transfer)
        self.max_batch = max_batch  # sequences an engine runs at once (--max-num-seqs)

    # -- per-request pieces (seconds) ----------------------------------------------------------------
    def vit(self, n: int) -> float:
        """One forward over n images (CPU preprocessing, where encoders do it there, in parallel threads)."""
        if not n:
            return 0.0
        cpu = math.ceil(n / self.costs.preprocess_threads) * self.costs.preprocess_ms
        return (n * self.costs.vit_per_image(n) + cpu) / 1e3

    def prefill(self, t: Traffic, n: int) -> float:
        return self.costs.prefill(self.costs.prompt_tokens(t.input_len, n)) / 1e3

    def media(self, n: int) -> float:
        """The frontend decoding a request's images (its pool decodes several at once)."""
        if n in self.costs.media_batch_ms:
            return self.costs.media_batch_ms[n] / 1e3
        return math.ceil(n / self.costs.media_threads) * self.costs.media_ms / 1e3 if n else 0.0

    def transfer(self, n: int) -> float:
        return n * self.costs.image_tokens * self.hidden_bytes / self.bandwidth

    def floor(self, t: Traffic, n: int) -> float:
        """A request's own compute, one part after the other: media, ViT, prefill."""
        return self.media(n) + self.vit(n) + self.prefill(t, n)

    def step(self, t: Traffic) -> Callable[[float], float]:
        context = t.mean(lambda n: self.costs.prompt_tokens(t.input_len, n)) + t.output_len / 2
        return lambda batch: self.costs.decode_step(batch, context) / 1e3

    def capacity(self, t: Traffic) -> float:
        """Requests/s one GPU sustains doing only this traffic's compute, one stage after another at full
        speed, decode batched up to ``max_batch``: 1 / (E[v + P] + L·t(max_batch) / max_batch) (dense:
        L·(b + c·ctx) + L·a / max_batch)."""
        context = t.mean(lambda n: self.costs.prompt_tokens(t.input_len, n)) + t.output_len / 2
        per_request = t.mean(lambda n: self.vit(n) + self.prefill(t, n)) * 1e3 + \
            t.output_len * self.costs.decode_per_token(self.max_batch, context)
        return 1e3 / per_request

    # -- sharing a GPU -------------------------------------------------------------------------------
    def k(self, x: str, y: str, mps: bool) -> float:
        """Slowdown of stage x while stage y runs in another process on the same GPU."""
        pair = {"prefill|decode": "vit|decode", "decode|prefill": "decode|vit"}.get(f"{x}|{y}", f"{x}|{y}")
        if not mps:
            return max(1.0, self.costs.corun.get(f"ts:{pair}", TIMESLICE))
        first, second = pair.split("|")
        beside, back = self.costs.corun.get(pair), self.costs.corun.get(f"{second}|{first}")
        if beside is None or back is None:
            return max(1.0, self.costs.corun.get(pair, MPS_UNMEASURED))
        # Two streams of one process split the GPU by who launches first (Qwen2.5-VL-7B's floor: decode
        # 4.6x slower beside the ViT, the ViT 1.15x; Qwen3-VL-30B-A3B's the other way round), while what
        # the pair gets done together, 1/k[x|y] + 1/k[y|x] of the GPU, holds (1.04-1.09 in both): two
        # MPS clients are taken to share that equally.
        return max(1.0, 2 / (1 / beside + 1 / back))

    # -- layouts -------------------------------------------------------------------------------------
    def predict(self, layout: Layout, t: Traffic, overheads: Overheads | None = None) -> Prediction:
        parts, tpot, busy = self._solve(layout, t)
        ttft = {n: self.media(n) + encode + first + (overheads(n) if overheads else 0.0)
                for n, (encode, first) in parts.items()}
        mean = sum(p * ttft[n] for p, n in t.classes())
        stable = math.isfinite(mean) and math.isfinite(tpot)
        return Prediction(layout.label(), layout.topology, layout.encoders, t.rate,
                          mean * 1e3 if stable else math.inf, tpot * 1e3 if stable else math.inf, stable,
                          {n: s * 1e3 for n, s in ttft.items()} if stable else {},
                          self.stages(t, parts) if stable else {}, busy)

    def stages(self, t: Traffic, parts: dict[int, tuple[float, float]]) -> dict[str, float]:
        """The model's frontend stages (ms), each a mean over the requests that have it as the frontend's
        are: media and encode over image requests, to first token over all (calibration left out)."""
        images = [(p, n) for p, n in t.classes() if n]
        share = sum(p for p, _ in images)
        out = {"first_token": sum(p * parts[n][1] for p, n in t.classes()) * 1e3}
        if share:
            out["media"] = sum(p * self.media(n) for p, n in images) / share * 1e3
            out["encode"] = sum(p * parts[n][0] for p, n in images) / share * 1e3
        return out

    def _solve(self, layout: Layout, t: Traffic) -> tuple[dict[int, tuple[float, float]], float, dict[str, float]]:
        """({images: (encode s, to first token s)}, TPOT s, busy shares) for one replica of the layout."""
        unstable = ({n: (math.inf, math.inf) for _, n in t.classes()}, math.inf, {})
        if layout.topology == "aggregated":
            return self._aggregated(t.rate / layout.gpus, t) or unstable
        return self._workers(layout, t) or unstable

    def _aggregated(self, rate: float, t: Traffic):
        """One engine thread, one server: between two engine steps a ViT batch of the images waiting
        (ahead of every prompt), then a step of at most ``step_tokens`` tokens: the decode rows, then
        prompt chunks shortest remaining first, as many as the budget holds (``EngineThread``)."""
        classes = t.classes()
        vit = {n: self.vit(n) for _, n in classes}
        prompt = {n: self.prefill(t, n) for _, n in classes}
        rho_vit = rate * t.mean(lambda n: vit[n])
        rho_work = rho_vit + rate * t.mean(lambda n: prompt[n])
        if rho_work >= 1:
            return None
        step = self.step(t)
        batch, tpot = decode_batch(rate, t.output_len, step, 1 / (1 - rho_work), self.max_batch)
        if not math.isfinite(tpot):
            return None
        rows = self.decode_rows(t, batch)  # the running batch's rows, in every step of a prompt too
        decoding = max(0.0, decode_busy(batch) - rho_work)  # share of time a pure decode step runs
        tokens = {n: self.costs.prompt_tokens(t.input_len, n) for _, n in classes}
        room = self.prompt_room(batch, rows, t.mean(lambda n: prompt[n]) / t.mean(lambda n: tokens[n]))
        full = max(self.step_tokens - batch, BLOCK_TOKENS)

        def solve(queued: float):
            rooms = {n: full if self.yields(rows, tokens[n] + queued, room, full) else room for n in tokens}
            steps = {n: [c + rows for c in self.chunks(t, n, prompt[n], rooms[n])] for _, n in classes}
            thread = EngineThread(rate, classes, vit, steps, decoding * step(batch) / 2)
            if thread.load(lambda n: vit[n] + thread.own(n)) >= 1:
                return None
            last_tokens = {n: tokens[n] - (len(steps[n]) - 1) * rooms[n] for n in tokens}
            fill = {n: max(0.0, rooms[n] - last_tokens[n]) for n in tokens}
            return thread.filled(thread.stages(), tokens, fill)

        # the budget yields to the prompt tokens the thread holds (``Scheduler.yields``): a prompt's own, and
        # those of the requests in the thread meanwhile (images queued for the ViT too), by Little's law from
        # the waits of a first solution
        ttft = solve(0.0)
        if ttft is not None and room < full:
            ttft = solve(rate * t.mean(lambda n: tokens[n] * sum(ttft[n])))
        if ttft is None:
            return None
        return ttft, tpot, {"vit+prefill": rho_work, "vit": rho_vit, "decode": decoding}

    def decode_rows(self, t: Traffic, batch: float) -> float:
        """Seconds ``batch`` decode rows add to a step that also computes prompt chunks (no fixed part:
        the step's launch is the chunk's; a MoE chunk's experts are the rows' too)."""
        context = t.mean(lambda n: self.costs.prompt_tokens(t.input_len, n)) + t.output_len / 2
        return self.costs.decode_rows(batch, context) / 1e3

    def prompt_room(self, batch: float, rows_s: float, token_s: float) -> float:
        """Prompt tokens a step computes beside ``batch`` decode rows (``rows_s`` seconds of them), prompt
        tokens costing ``token_s`` each: what the token budget leaves, and with a time target no more than
        what the target leaves, a block at least (``Scheduler``)."""
        tokens = self.step_tokens - batch
        if not self.target_itl_s or batch < 1:
            return tokens
        return min(tokens, max(BLOCK_TOKENS, (self.target_itl_s - rows_s) / token_s))

    def yields(self, rows_s: float, queued: float, room: float, full: float) -> bool:
        """The time budget gives way (``Scheduler.yields``): steps of ``room`` prompt tokens beside decode rows
        of ``rows_s`` would give the last of ``queued`` prompt tokens its first token more than one target
        step later than steps of ``full`` tokens."""
        return bool(self.target_itl_s) and room < full and rows_s * queued * (1 / room - 1 / full) > self.target_itl_s

    def chunks(self, t: Traffic, n: int, seconds: float, room: float) -> list[float]:
        """A prompt's steps (seconds each): ``room`` prompt tokens at most, its time split by tokens."""
        tokens = self.costs.prompt_tokens(t.input_len, n)
        k = max(1, math.ceil(tokens / room))
        return [seconds * min(room, tokens - i * room) / tokens for i in range(k)]

    def _workers(self, layout: Layout, t: Traffic):
        """Encoders and language workers, sharing GPUs as the layout says."""
        lm_rate = t.rate / (layout.prefill_gpus or layout.lm_gpus)  # requests per prefilling worker
        decode_rate = t.rate / (layout.decode_gpus or layout.lm_gpus)
        encoders = layout.encoders
        image_rate = t.rate * t.image_share  # image requests over the whole encoder tier
        vit_own = {n: self.vit(math.ceil(n / encoders)) if n else 0.0 for _, n in t.classes()}
        image_classes = [n for _, n in t.classes() if n]
        vit_mean = sum(vit_own[n] for n in image_classes) / len(image_classes) if image_classes else 0.0
        vit_sq = sum(vit_own[n] ** 2 for n in image_classes) / len(image_classes) if image_classes else 0.0
        prefill_mean = t.mean(lambda n: self.prefill(t, n))
        prefill_sq = t.mean(lambda n: self.prefill(t, n) ** 2)
        joined = layout.pd == "joined"
        # who shares a GPU with whom (activities of other processes on the same GPU)
        peers = {"vit": [], "prefill": [], "decode": []}
        if layout.topology == "colocated":
            peers = {"vit": ["prefill", "decode"], "prefill": ["vit"] + ([] if joined else ["decode"]),
                     "decode": ["vit"] + ([] if joined else ["prefill"])}
        elif layout.shared_pd:
            peers = {"vit": [], "prefill": ["decode"], "decode": ["prefill"]}
        slow = dict.fromkeys(peers, 1.0)
        step = self.step(t)
        for _ in range(100):
            vit_busy = image_rate * vit_mean * slow["vit"]  # per encoder: every request sends each its share
            prefill_busy = lm_rate * prefill_mean * slow["prefill"]
            if vit_busy >= 1 or prefill_busy >= 1:
                return None
            batch, tpot = decode_batch(decode_rate, t.output_len, step,
                                       slow["decode"] / (1 - prefill_busy if joined else 1), self.max_batch)
            if not math.isfinite(tpot):
                return None
            decode_active = max(0.0, decode_busy(batch) - (prefill_busy if joined else 0.0))
            busy = {"vit": vit_busy, "prefill": prefill_busy, "decode": decode_active}
            new = {x: 1 + sum(busy[y] * (self.k(x, y, layout.mps) - 1) for y in ys) for x, ys in peers.items()}
            if all(abs(new[x] - slow[x]) < 1e-6 for x in slow):
                break
            slow = {x: 0.5 * (slow[x] + new[x]) for x in slow}  # damped: the shares and slowdowns feed each other
        encode_wait = mg1_wait(image_rate, vit_mean * slow["vit"], vit_sq * slow["vit"] ** 2) if image_classes else 0.0
        prefill_wait = mg1_wait(lm_rate, prefill_mean * slow["prefill"], prefill_sq * slow["prefill"] ** 2)
        if not math.isfinite(encode_wait) or not math.isfinite(prefill_wait):
            return None
        in_the_way = decode_active * step(batch) * slow["decode"] / 2 if joined else 0.0
        ttft = {}
        for _, n in t.classes():
            encode = encode_wait + vit_own[n] * slow["vit"] if n else 0.0
            ttft[n] = (encode, prefill_wait + in_the_way + self.prefill(t, n) * slow["prefill"] + self.transfer(n))
        return ttft, tpot, {**busy, **{f"slowdown_{x}": s for x, s in slow.items()}}
