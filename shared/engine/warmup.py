"""What the engine thread does before its worker serves (the worker registers after both):

- ``warm_thread``: what libraries cache per thread, built in the thread that will step the engine;
- ``warm_steps``: a few engine steps of the shapes serving reaches, so every kernel variant they launch is
  compiled before a request comes (an eager forward past the prefill graphs' buckets runs the first
  layer's norm without a residual and the MoE at larger tiles: variants no graph capture compiles); where
  the engine has a time budget they are timed and give the step-time model its first fit
  (``shared.engine.step_time``, ``calibrate``).

The calibration steps are the serving path's own (``ModelRunner.prefill`` on sequences of placeholder tokens whose
blocks are taken from the pool and given back): prompts alone at three lengths up to the step budget, a
chunk after a prefix, and decode rows riding along with a chunk at two batch sizes and two contexts — at
least as many shapes as the model has costs, each cost varied on its own. Every shape is one the start-up
has prepared: token counts within the prefill graphs' buckets or eager past them, decode rows through
the splits their graph bucket compiled, attention plans made by ``warm_thread``. Each runs twice and the
faster run counts, so what a first run still builds (an allocator segment, a Triton variant of the prefix
kernel) is warm-up, not a cost the model learns, and so is a moment of contention with another process
starting on the same GPU (an E/PD encoder capturing its graphs). The KV they write is never read: the blocks go back free,
never indexed for the prefix cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.engine.block_manager import blocks_for
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import Chunk
from shared.engine.sequence import Sequence, Status
from shared.engine.step_time import StepShape
from shared.logging import get_logger

log = get_logger(__name__)

ROWS = (8, 64)  # decode rows of the mixed trials (graph buckets), at most max_num_seqs
CONTEXT = 512  # decode rows' context (and four times it), at most what the pool holds


@dataclass(frozen=True)
class Trial:
    prompt: int  # prompt tokens of the chunk
    prefix: int = 0  # tokens before the chunk, computed already
    rows: int = 0  # decode rows riding along
    context: int = 0  # each row's context

    def shape(self) -> StepShape:
        return StepShape.of_decode([self.context + 1] * self.rows).with_chunk(self.prefix, self.prompt)

    def blocks(self, block_size: int) -> int:
        return blocks_for(self.prefix + self.prompt, block_size) + self.rows * blocks_for(self.context + 1, block_size)


def trials(budget: int, block_size: int, pool_blocks: int, max_len: int, max_rows: int) -> list[Trial]:
    """Shapes within the step budget, ``max_len`` and the pool's ``pool_blocks`` (a small pool: shorter
    contexts, and the trials that still do not fit are left out)."""
    budget = max(1, min(budget, max_len - 1))
    small, half = max(1, budget // 8), max(1, budget // 2)
    few, many = (min(rows, max_rows) for rows in ROWS)
    room = (pool_blocks - blocks_for(half, block_size)) * block_size
    context = max(1, min(CONTEXT, (max_len - 2) // 4, room // max(many, 4 * few) - block_size))
    out = [Trial(small), Trial(half), Trial(budget), Trial(max(1, budget // 4), prefix=budget // 2),
           Trial(small, rows=few, context=context), Trial(small, rows=few, context=4 * context),
           Trial(small, rows=many, context=context), Trial(half, rows=many, context=context)]
    return [t for t in out if t.blocks(block_size) <= pool_blocks and t.prefix + t.prompt < max_len]


def warm_thread(engine) -> int:
    """cuDNN's attention plans for every fresh chunk length up to the step budget (``shared.kernels.sdpa``),
    which it keeps per thread: call in the thread that will step ``engine``. Returns how many plans;
    without it each is built by a first request."""
    warm = getattr(engine.runner.backend, "warm", None)
    if warm is None:
        return 0
    started = time.perf_counter()
    plans = warm(engine.runner.model.config.num_heads, min(engine.scheduler.max_batched_tokens, engine.max_model_len))
    if plans:
        log.info("engine.warmed", attention_plans=plans, ms=round((time.perf_counter() - started) * 1e3))
    return plans


def warm_steps(engine) -> int:
    """Run the trial steps of ``engine``'s role in the thread that steps it, before it serves: timed, and the
    step-time model fitted to them, where it has a time budget (``calibrate``); once each otherwise (a
    prefill worker: its prompt trials; ``--target-itl-ms 0``). A decode worker's steps are its captured
    graphs. Returns how many steps ran."""
    if engine.role == "decode":
        return 0
    if engine.step_times is not None:
        return calibrate(engine)
    started = time.perf_counter()
    plan = role_trials(engine)
    for trial in plan:
        run_trial(engine, trial, times=1)
    log.info("engine.warmed_steps", steps=len(plan), ms=round((time.perf_counter() - started) * 1e3))
    return len(plan)


def calibrate(engine) -> int:
    """Fit ``engine``'s step-time model to timed trial steps (in the thread that steps it, before it
    serves); returns how many steps were timed (0: the engine has no time budget)."""
    if engine.step_times is None:
        return 0
    started = time.perf_counter()
    samples = measure(engine)
    engine.step_times.calibrate(samples)
    errors = [abs(engine.step_times.predict(shape) / seconds - 1) for shape, seconds in samples] or [0.0]
    log.info("engine.step_time_calibrated", steps=len(samples), ms=round((time.perf_counter() - started) * 1e3),
             target_ms=round(engine.scheduler.target_s * 1e3, 1), fit_error=round(sum(errors) / len(errors), 3),
             **engine.step_times.coefficients())
    return len(samples)


def role_trials(engine) -> list[Trial]:
    """``trials`` for ``engine``'s pool and budget; a prefill worker's without decode rows (it has none)."""
    blocks = engine.blocks
    plan = trials(engine.scheduler.max_batched_tokens, blocks.block_size, blocks.num_free, engine.max_model_len,
                  engine.scheduler.max_num_seqs)
    return [t for t in plan if not t.rows] if engine.role == "prefill" else plan


def measure(engine) -> list[tuple[StepShape, float]]:
    """(shape, seconds of its faster run) of each trial, on ``engine``'s runner and pool (left as found)."""
    return [(trial.shape(), run_trial(engine, trial, times=2)) for trial in role_trials(engine)]


def run_trial(engine, trial: Trial, times: int) -> float:
    """Step ``trial`` ``times`` times on ``engine``'s runner (its blocks given back after); the fastest run's seconds."""
    runner, blocks = engine.runner, engine.blocks
    seqs, chunks = _trial_chunks(trial, blocks)
    try:
        seconds = []
        for _ in range(times):
            _sync(runner.device)
            began = time.perf_counter()
            runner.prefill(chunks)
            _sync(runner.device)
            seconds.append(time.perf_counter() - began)
        return min(seconds)
    finally:
        for seq in seqs:
            blocks.deallocate(seq)


def _trial_chunks(trial: Trial, blocks) -> tuple[list[Sequence], list[Chunk]]:
    """Placeholder sequences holding blocks, and the step's chunks: decode rows first, then the prompt."""
    params = SamplingParams(temperature=0, max_tokens=1)
    seqs, chunks = [], []
    for i in range(trial.rows):
        row = Sequence(f"calibration-row-{i}", [0] * (trial.context + 1), trial.context, params,
                       status=Status.RUNNING, num_computed=trial.context)
        blocks.allocate(row, trial.context + 1)
        seqs.append(row)
        chunks.append(Chunk(row, trial.context, trial.context + 1))
    length = trial.prefix + trial.prompt
    prompt = Sequence("calibration-prompt", [0] * length, length, params, status=Status.RUNNING,
                      num_computed=trial.prefix)
    blocks.allocate(prompt, length)
    seqs.append(prompt)
    chunks.append(Chunk(prompt, trial.prefix, length))
    return seqs, chunks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
