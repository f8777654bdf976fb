#!/usr/bin/env python3
"""Multi-turn image chat, prefix caching on and off: the same conversations on two stacks of one topology.
The claim (the issue): ≥ 16 users × 6 turns, 2–5 images per conversation, new text each turn: TTFT from
turn 2 on ≥ 3× lower with prefix caching, the same outputs.

A user's first turn carries its images (2–5, seeded per user; 1080p JPEGs, small with --tiny) and text;
each later turn appends the previous answer and new text, so a turn's prompt, images included, is a prefix
of the next one's, which without caching prefills it all again. Users run at once, each its turns in order
(greedy, ignore_eos), after one warm-up chat on images of its own. The encoders' embedding cache is on in
both runs (the default): the ViT work is alike, the difference is the language model's prefill. Cached
tokens: each answer's usage, and the workers' ``vllm:prefix_cache_hits`` / ``_queries`` on ``/metrics``.

    python bench/multi_turn_chat.py --dry-run
    python bench/multi_turn_chat.py --out bench/results/multi_turn_chat      # GPU: the 7B, dummy weights
    python bench/multi_turn_chat.py --tiny --out /tmp/mt                       # CPU smoke, tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.epd_vs_aggregated import stack_env, tokenizer_dir, topologies, ucx_works  # noqa: E402
from shared.model.presets import PRESETS  # noqa: E402
from tools.bench.client import RequestResult, request_body, send  # noqa: E402
from tools.bench.dataset import ImagePool, PromptWriter, RequestSpec  # noqa: E402
from tools.bench.environment import hardware, versions, visible_gpus  # noqa: E402
from tools.bench.runner import LoadGenerator  # noqa: E402
from tools.bench.settings import BenchSettings, parse_resolution  # noqa: E402
from tools.bench.stack import StackProcess  # noqa: E402

TARGET = 3.0  # TTFT from turn 2 on, without caching over with it
MODES = {"no caching": False, "caching": True}  # in this order: the second replays the first's histories
DEFAULTS = {False: dict(users=16, turns=6, max_tokens=64, input_len=64, image_resolution="1080p"),
            True: dict(users=3, turns=3, max_tokens=8, input_len=16, image_resolution="224x224")}
_COUNTER = re.compile(r'^vllm:prefix_cache_(hits|queries)(?:_total)?\{[^}]*\} (\S+)$', re.M)


@dataclass(frozen=True)
class Conversation:
    """One user's chat: its images (ids into the pool) and the new user text of every turn."""

    user: int
    image_ids: tuple[int, ...]
    texts: tuple[str, ...]


def conversations(args, writer: PromptWriter) -> list[Conversation]:
    """The users' chats and, last, the warm-up's; seeded per user so both stacks get the same ones, each
    user on images of its own (no hits across users)."""
    out, next_id = [], 0
    for user in range(args.users + 1):
        rng = np.random.default_rng([args.seed, user])
        count = int(rng.integers(2, 6))  # drawn before the text: the same with or without a tokenizer
        texts = tuple(writer.write(rng, args.input_len) for _ in range(args.turns))
        out.append(Conversation(user, tuple(range(next_id, next_id + count)), texts))
        next_id += count
    return out


async def prefix_counters(api: str) -> dict[str, float]:
    """The workers' prefix-cache counters (prompt tokens looked up / found), summed by the frontend. Final
    once the answers are in, with no wait: a prompt's tokens are counted when its prefill is computed,
    before its first token, and ``/metrics`` asks every worker for its figures at scrape time."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(api.removesuffix("/v1") + "/metrics")).text
    return {kind: float(value) for kind, value in _COUNTER.findall(text)}


class ChatRun:
    """The conversations on one stack: the warm-up chat, then every user at once, each its turns in order."""

    def __init__(self, args, api: str, pool: ImagePool):
        self.args, self.api, self.pool = args, api, pool
        self.generator = LoadGenerator(BenchSettings(base_url=api, timeout=args.request_timeout))
        self.t0 = time.perf_counter()

    async def run(self, chats: list[Conversation], replay: list[list[str]] | None = None) -> dict:
        """``replay``: each user's earlier answers to put in its history (another run's), so both runs
        send the very same prompts and their answers can be compared turn by turn."""
        try:
            await self.generator.resolve_model()
            warm = await self.chat(chats[-1], min(2, self.args.turns))
            if failed := [r.error for r in warm if not r.ok]:
                raise RuntimeError(f"the warm-up chat failed: {failed[0]}")
            before = await prefix_counters(self.api)
            started = time.perf_counter()
            users = await asyncio.gather(*(self.chat(c, self.args.turns, replay[i] if replay else None)
                                           for i, c in enumerate(chats[:-1])))
            seconds = time.perf_counter() - started
            after = await prefix_counters(self.api)
        finally:
            await self.generator.close()
        return {"seconds": seconds, "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
                "users": [[{**r.record(), "text": r.text} for r in turns] for turns in users]}

    async def chat(self, chat: Conversation, turns: int, answers: list[str] | None = None) -> list[RequestResult]:
        """One user's turns, each after the previous answer (its own, or ``answers[turn - 1]``); a
        failed turn ends the chat (the next one would need its answer)."""
        spec = RequestSpec(chat.user, "image", chat.texts[0], chat.image_ids, self.args.max_tokens)
        messages = self.pool.messages(spec)
        results: list[RequestResult] = []
        for turn in range(turns):
            if turn:
                if answers is not None and turn > len(answers):
                    break  # the replayed run's chat ended here
                answer = answers[turn - 1] if answers is not None else results[-1].text
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": chat.texts[turn]}]
            body = request_body(self.generator.model, messages, spec, ignore_eos=True)
            results.append(await send(self.generator.client, self.generator.url, body, spec, self.t0))
            if not results[-1].ok:
                break
        return results


def stack_of(args, caching: bool) -> StackProcess:
    env = stack_env(args)
    env["EPD_PREFIX_CACHING"] = "true" if caching else "false"  # every LM worker's engine setting
    return StackProcess(list(args.layout.args), env, ROOT)


def run_both(args, pool: ImagePool, chats: list[Conversation]) -> dict[str, dict]:
    """Each mode on a stack of its own, one after the other, the second on the first's histories. Tiny:
    both start up front (start-up dominates a CPU smoke run; the idle stack costs next to nothing)."""
    first = next(iter(MODES))
    early = {mode: stack_of(args, on) for mode, on in MODES.items()} if args.tiny else {}
    out: dict[str, dict] = {}
    try:
        for mode, on in MODES.items():
            started = time.monotonic()
            stack = early.get(mode) or stack_of(args, on)
            try:
                api = stack.wait_ready(900)
                print(f"## {mode}: {api} (up in {time.monotonic() - started:.0f} s)", flush=True)
                replay = [[r["text"] for r in user] for user in out[first]["users"]] if out else None
                out[mode] = asyncio.run(ChatRun(args, api, pool).run(chats, replay))
            finally:
                stack.stop()
    finally:
        for stack in early.values():
            stack.stop()
    return out


def answered(run: dict, turns: slice) -> list[dict]:
    """Every user's answered turns of this slice (a failed turn ended its chat)."""
    return [r for user in run["users"] for r in user[turns] if r["ok"]]


def mean_ttft_ms(results: list[dict]) -> float:
    return 1e3 * sum(r["ttft"] for r in results) / len(results) if results else float("nan")


def per_turn(run: dict, turns: int) -> list[dict]:
    """Per turn index: mean TTFT (ms), mean prompt tokens, the share of them the prefix cache served."""
    out = []
    for turn in range(turns):
        done = answered(run, slice(turn, turn + 1))
        prompt = sum(r["prompt_tokens"] for r in done)
        out.append({"turn": turn + 1, "answered": len(done), "ttft_ms": mean_ttft_ms(done),
                    "prompt_tokens": prompt / max(1, len(done)),
                    "cached_share": sum(r["cached_tokens"] for r in done) / prompt if prompt else 0.0})
    return out


def mismatches(runs: dict[str, dict], turns: slice) -> tuple[int, int]:
    """(turns of this slice whose answers differ or are missing in one run, turns compared): the
    prompts are the same in both runs (the second replays the first's histories)."""
    off, on = (runs[m]["users"] for m in MODES)
    pairs = [(a[t] if t < len(a) else None, b[t] if t < len(b) else None)
             for a, b in zip(on, off) for t in range(max(len(a), len(b)))[turns]]
    return sum(x is None or y is None or x["text"] != y["text"] for x, y in pairs), len(pairs)


def summarize(args, runs: dict[str, dict]) -> dict:
    turns = {mode: per_turn(run, args.turns) for mode, run in runs.items()}
    with_, without = (mean_ttft_ms(answered(runs[m], slice(1, None))) for m in ("caching", "no caching"))
    differ, compared = mismatches(runs, slice(None))
    first_differ, first_compared = mismatches(runs, slice(0, 1))
    failed = sum(not r["ok"] for run in runs.values() for u in run["users"] for r in u)
    return {"turns": turns, "later_ttft_ms": {"caching": with_, "no caching": without},
            "ratio": without / with_ if with_ else float("nan"), "mismatches": differ, "compared": compared,
            "first_turn_mismatches": first_differ, "first_turns": first_compared,
            "failed": failed, "counters": {m: runs[m]["counters"] for m in MODES}}


def report(args, meta: dict, summary: dict) -> str:
    lines = [f"Hardware: {meta['hardware']}", f"Versions: {json.dumps(meta['versions'])}",
             f"Command: {' '.join(meta['command'])}", f"Wall time: {meta['wall_s']:.0f} s", "",
             f"{args.users} users × {args.turns} turns, 2–5 × {args.image_resolution} images in the first turn, "
             f"{args.input_len} new text tokens a turn, {args.max_tokens} out (greedy, ignore_eos); topology "
             f"{args.topology} (`epd up {' '.join(args.layout.args)}`), {meta['model']}.", "",
             "| turn | prompt tokens | TTFT with caching (ms) | without (ms) | × lower | cached share (usage) |",
             "|---|---|---|---|---|---|"]
    for on, off in zip(summary["turns"]["caching"], summary["turns"]["no caching"]):
        lines.append(f"| {on['turn']} | {on['prompt_tokens']:.0f} | {on['ttft_ms']:.0f} | {off['ttft_ms']:.0f} | "
                     f"{off['ttft_ms'] / on['ttft_ms']:.2f} | {on['cached_share']:.0%} |")
    later = summary["later_ttft_ms"]
    counters = "; ".join(f"{m}: {c.get('hits', 0):.0f} of {c.get('queries', 0):.0f} prompt tokens"
                         for m, c in summary["counters"].items())
    lines += ["", f"Turns ≥ 2: mean TTFT {later['caching']:.0f} ms with caching, {later['no caching']:.0f} ms "
              f"without. Workers' prefix-cache hits: {counters}. Failed requests: {summary['failed']}.",
              f"Same outputs in both runs (the same prompts: the caching run replays the other's histories): "
              f"{summary['mismatches']} of {summary['compared']} turns differ — "
              f"{'yes' if summary['mismatches'] == 0 else 'no'}; of them in turn 1, where neither run has a "
              f"prefix cached (only the batches around each prompt differ): {summary['first_turn_mismatches']} of "
              f"{summary['first_turns']}.",
              f"TTFT from turn 2 on ≥ {TARGET:g}× lower with prefix caching: measured {summary['ratio']:.2f}× — "
              f"{'yes' if summary['ratio'] >= TARGET else 'no'}"]
    return "\n".join(lines) + "\n"


def dry_run(args, chats: list[Conversation]) -> int:
    """What would run (the chats drawn without the tokenizer: the same image counts)."""
    print(f"{args.users} users × {args.turns} turns at once, {args.input_len} text tokens new a turn, "
          f"{args.max_tokens} out; images {args.image_resolution}, per user: "
          + " ".join(str(len(c.image_ids)) for c in chats[:-1]) + f"; seed {args.seed}; one warm-up chat first")
    for mode, on in MODES.items():
        print(f"stack {mode:10} EPD_PREFIX_CACHING={'true' if on else 'false'} python -m launcher.cli up "
              f"--port 0 {' '.join(args.layout.args)}")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/multi_turn_chat", help="directory for results")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on the built-in tiny model")
    parser.add_argument("--dry-run", action="store_true", help="print what would run")
    parser.add_argument("--topology", default="aggregated", help="a layout label of bench/epd_vs_aggregated.py "
                        "(aggregated, E/PD, E/PD+MPS, E/P/D, E/P/D+MPS, ...)")
    for name, kind in (("users", int), ("turns", int), ("max-tokens", int), ("input-len", int),
                       ("image-resolution", str)):
        parser.add_argument(f"--{name}", type=kind, help="default: 16 / 6 / 64 / 64 / 1080p (tiny: 3 / 3 / 8 / 16 / "
                                                         "224x224)")
    parser.add_argument("--model", default="qwen2.5-vl-7b", choices=sorted(PRESETS), help="preset, dummy weights")
    parser.add_argument("--kv-cache-mb", type=int, default=20480, help="KV pool of every LM process (MiB)")
    parser.add_argument("--max-batched-tokens", type=int, default=0,
                        help="every LM worker's step budget (EPD_MAX_BATCHED_TOKENS; 0: the engine's default)")
    parser.add_argument("--transport", default="auto", choices=("auto", "zmq", "ucx"))
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds one turn may take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.tiny].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if min(args.users, args.turns, args.max_tokens, args.input_len) < 1:
        parser.error("--users, --turns, --max-tokens and --input-len must be at least 1")
    layouts = {t.label: t for t in topologies(0 if args.tiny else visible_gpus(), args.tiny)}
    if args.topology not in layouts:
        parser.error(f"--topology {args.topology}: choose from {', '.join(layouts)}")
    args.layout = layouts[args.topology]
    if args.transport == "auto":
        args.transport = "ucx" if not args.tiny and ucx_works() else "zmq"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args, conversations(args, PromptWriter()))
    started = time.monotonic()
    tokenizer = tokenizer_dir(args.tiny, args.model)
    chats = conversations(args, PromptWriter(tokenizer))
    pool = ImagePool(parse_resolution(args.image_resolution), "jpeg", args.seed)
    pool.generate(sum(len(c.image_ids) for c in chats))
    runs = run_both(args, pool, chats)
    summary = summarize(args, runs)
    meta = {"hardware": hardware(), "versions": versions(), "command": sys.argv, "wall_s": time.monotonic() - started,
            "model": "tiny" if args.tiny else f"{args.model} (dummy weights)", "transport": args.transport}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = report(args, meta, summary)
    (out / "results.md").write_text(markdown)
    settings = {**vars(args), "layout": list(args.layout.args)}  # the layout as its `epd up` flags
    (out / "results.json").write_text(json.dumps({**meta, "settings": settings, "summary": summary, "runs": runs},
                                                 indent=1))
    print("\n" + markdown)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
