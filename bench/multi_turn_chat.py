#!/usr/bin/env python3
"""Multi-turn image chat: the same conversations on two stacks of one topology, one without what is measured
("before") and one with it ("after"). What is measured (``--baseline``):

- ``no-prefix-routing`` (issue 42, the default): the frontend's prefix-aware routing, which sends a prompt to
  the language worker holding its longest prefix and leaves out the images that worker holds, so a
  returning image is neither decoded, encoded nor moved again. Before: ``EPD_PREFIX_ROUTING=false`` (by
  load alone, every image sent; the workers' prefix caches still serve the prompt). Target: TTFT from
  turn 2 on ≤ 1.5× that of its text twin (below).
- ``no-caching`` (issue 14): prefix caching itself. Before: ``EPD_PREFIX_CACHING=false``. Target: TTFT
  from turn 2 on ≥ 3× lower with it.
- ``none``: both stacks on the defaults, a control: how many answers differ from one stack to the next
  (two starts, the same prompts) when nothing is changed.

A user's first turn carries its images (2–5, seeded per user; 1080p JPEGs, small with --tiny) and text;
each later turn appends the previous answer and new text, so a turn's prompt, images included, is a prefix
of the next one's. After one warm-up chat on images of its own, every user's turn 1 runs at once, then,
once all are answered, every user's later turns (each user's in order; greedy, ignore_eos). The "after"
stack replays the "before" stack's histories, so both send the same prompts and their answers can be
compared turn by turn (on a GPU in bf16 a random-weight model's answers also differ with the batches
around a prompt: turn 1, which the feature does not touch, is the control). So that answers can be held
equal on a GPU too, ``--alone-users`` more chats (images of their own) then run one turn at a time with
nothing else on the stack: the same prompts in the same batches (of one) on both stacks, so any difference
is the feature's. The encoders' embedding cache is on in both runs (the default).

Measured per stack: TTFT per turn; the cached share (usage's ``cached_tokens``; the workers'
``vllm:prefix_cache_*``); and from turn 2 on, per turn, from the services' own stats on ``/metrics``: the
frontend's CPU time, the images it decoded and left out, and the data-plane bytes — the decoded pixels it
published (for encoders, or a worker that encodes in place, to pull) and the embeddings the language
workers pulled. Then, on the "after" stack, each user's text twin: the same conversation with each image
replaced by text of its token count (the same new text, answers and prompt length, text only), whose TTFT
from turn 2 on is what a turn costs over a cached prefix of that length.

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
from shared.model.geometry import ImageGeometry  # noqa: E402
from shared.model.presets import PRESETS  # noqa: E402
from tools.bench.client import RequestResult, request_body, send  # noqa: E402
from tools.bench.dataset import ImagePool, PromptWriter, RequestSpec  # noqa: E402
from tools.bench.environment import hardware, versions, visible_gpus  # noqa: E402
from tools.bench.runner import LoadGenerator  # noqa: E402
from tools.bench.settings import BenchSettings, parse_resolution  # noqa: E402
from tools.bench.stack import StackProcess  # noqa: E402

BASELINES = {"no-prefix-routing": {"EPD_PREFIX_ROUTING": "false"}, "no-caching": {"EPD_PREFIX_CACHING": "false"},
             "none": {}}
TEXT_TARGET = 1.5  # no-prefix-routing: TTFT from turn 2 on, image chat over its text twin, at most
CACHING_TARGET = 3.0  # no-caching: TTFT from turn 2 on, before over after, at least
MODES = ("before", "after")  # in this order: the second replays the first's histories
DEFAULTS = {False: dict(users=16, turns=6, max_tokens=64, input_len=64, image_resolution="1080p", alone_users=2),
            True: dict(users=3, turns=3, max_tokens=8, input_len=16, image_resolution="224x224", alone_users=1)}
_COUNTER = re.compile(r'^vllm:prefix_cache_(hits|queries)(?:_total)?\{[^}]*\} (\S+)$', re.M)
_STAT = re.compile(r'^epd_service_stat\{([^}]*)\} (\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
FRONTEND_STATS = ("cpu_seconds", "images_decoded", "images_recognised", "images_cached", "pixel_bytes_published")
WORKER_STATS = ("embedding_bytes_pulled", "images_pulled")
WORKERS = ("epd-language", "epd-prefill", "epd-aggregated")


@dataclass(frozen=True)
class Conversation:
    """One user's chat: its images (ids into the pool) and the new user text of every turn; a text twin
    has no images and ``filler`` (text of their token count) before its first turn's text."""

    user: int
    image_ids: tuple[int, ...]
    texts: tuple[str, ...]
    filler: str = ""


def conversations(args, writer: PromptWriter) -> list[Conversation]:
    """The users' chats, the warm-up's, then the ``--alone-users``' chats; seeded per user so both stacks
    get the same ones, each user on images of its own (no hits across users)."""
    out, next_id = [], 0
    for user in range(args.users + 1 + args.alone_users):
        rng = np.random.default_rng([args.seed, user])
        count = int(rng.integers(2, 6))  # drawn before the text: the same with or without a tokenizer
        texts = tuple(writer.write(rng, args.input_len) for _ in range(args.turns))
        out.append(Conversation(user, tuple(range(next_id, next_id + count)), texts))
        next_id += count
    return out


def text_twins(chats: list[Conversation], image_tokens: int, writer: PromptWriter, seed: int) -> list[Conversation]:
    """Each chat with its images replaced by text of their token count (``image_tokens`` each)."""
    out = []
    for chat in chats:
        rng = np.random.default_rng([seed, chat.user, 1])
        filler = writer.write(rng, image_tokens * len(chat.image_ids)) + "\n\n"
        out.append(Conversation(chat.user, (), chat.texts, filler))
    return out


async def stack_figures(api: str) -> dict[str, float]:
    """What the stack's services counted so far: the workers' prefix-cache counters (prompt tokens looked up
    / found), the frontend's ``FRONTEND_STATS`` and the language workers' ``WORKER_STATS``, each summed
    over instances. Final once the answers are in, with no wait: ``/metrics`` asks every service for its
    figures at scrape time, and a prompt's are counted before its first token."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(api.removesuffix("/v1") + "/metrics")).text
    out = {kind: float(value) for kind, value in _COUNTER.findall(text)}
    for labels, value in _STAT.findall(text):
        label = dict(_LABEL.findall(labels))
        service, stat = label.get("service", ""), label.get("stat", "")
        side = "frontend" if service == "epd-frontend" and stat in FRONTEND_STATS else \
            "workers" if service in WORKERS and stat in WORKER_STATS else ""
        if side:
            out[f"{side}.{stat}"] = out.get(f"{side}.{stat}", 0.0) + float(value)
    return out


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


@dataclass
class UserChat:
    """One user's chat as it runs: its messages so far, its answered turns, the answers to replay."""

    chat: Conversation
    messages: list[dict]
    results: list[RequestResult]
    replay: list[str] | None = None

    @property
    def going(self) -> bool:
        return all(r.ok for r in self.results)


class ChatRun:
    """The conversations on one stack: the warm-up chat, then every user's turn 1 at once, then every user's
    later turns at once (each user's in order), the stack's figures read around each phase."""

    def __init__(self, args, api: str, pool: ImagePool):
        self.args, self.api, self.pool = args, api, pool
        self.generator = LoadGenerator(BenchSettings(base_url=api, timeout=args.request_timeout))
        self.t0 = time.perf_counter()

    async def run(self, chats: list[Conversation], alone: list[Conversation],
                  replay: dict[str, list[list[str]]] | None = None) -> dict:
        """``chats``: the users' and, last, the warm-up's; ``alone``: chats run one turn at a time afterwards;
        ``replay``: each user's earlier answers (``users``, ``alone``) to put in its history (another run's),
        so both runs send the very same prompts and their answers can be compared turn by turn."""
        try:
            await self.generator.resolve_model()
            warm = self.start(chats[-1])
            await self.turns(warm, 0, min(2, self.args.turns))
            if not warm.going:
                raise RuntimeError(f"the warm-up chat failed: {warm.results[-1].error}")
            users = [self.start(c, replay["users"][i] if replay else None) for i, c in enumerate(chats[:-1])]
            marks = [await stack_figures(self.api)]
            started = time.perf_counter()
            for first, last in ((0, 1), (1, self.args.turns)):
                await asyncio.gather(*(self.turns(u, first, last) for u in users))
                marks.append(await stack_figures(self.api))
            seconds = time.perf_counter() - started
            alone_users = [self.start(c, replay["alone"][i] if replay else None) for i, c in enumerate(alone)]
            for user in alone_users:  # each turn alone on the stack
                await self.turns(user, 0, self.args.turns)
        finally:
            await self.generator.close()
        return {"seconds": seconds, "counters": spent(marks[0], marks[2]), "later": spent(marks[1], marks[2]),
                "users": answers(users), "alone": answers(alone_users)}

    def start(self, chat: Conversation, replay: list[str] | None = None) -> UserChat:
        spec = RequestSpec(chat.user, "image" if chat.image_ids else "text", chat.filler + chat.texts[0],
                           chat.image_ids, self.args.max_tokens)
        return UserChat(chat, self.pool.messages(spec), [], replay)

    async def turns(self, user: UserChat, first: int, last: int) -> None:
        """Turns ``[first, last)`` of one user, each after the previous answer (its own, or the replayed
        one); a failed turn ends the chat (the next one would need its answer)."""
        chat = user.chat
        for turn in range(first, last):
            if not user.going or (user.replay is not None and turn > len(user.replay)):
                return  # failed, or the replayed run's chat ended here
            if turn:
                answer = user.replay[turn - 1] if user.replay is not None else user.results[-1].text
                user.messages += [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": chat.texts[turn]}]
            spec = RequestSpec(chat.user, "image" if chat.image_ids else "text", chat.texts[turn], chat.image_ids,
                               self.args.max_tokens)
            body = request_body(self.generator.model, user.messages, spec, ignore_eos=True)
            user.results.append(await send(self.generator.client, self.generator.url, body, spec, self.t0))


def answers(users: list[UserChat]) -> list[list[dict]]:
    return [[{**r.record(), "text": r.text} for r in u.results] for u in users]


def stack_of(args, mode: str) -> StackProcess:
    env = stack_env(args)
    env.update(BASELINES[args.baseline] if mode == "before" else {})
    return StackProcess(list(args.layout.args), env, ROOT)


def run_modes(args, pool: ImagePool, chats: list[Conversation], alone: list[Conversation],
              twins: list[Conversation]) -> dict[str, dict]:
    """Each mode on a stack of its own, one after the other, the second on the first's histories, then the
    text twins on the second (on the same histories). Tiny: both start up front (start-up dominates a CPU
    smoke run; the idle stack costs next to nothing)."""
    early = {mode: stack_of(args, mode) for mode in MODES} if args.tiny else {}
    out: dict[str, dict] = {}
    try:
        for mode in MODES:
            started = time.monotonic()
            stack = early.get(mode) or stack_of(args, mode)
            try:
                api = stack.wait_ready(900)
                print(f"## {mode}: {api} (up in {time.monotonic() - started:.0f} s)", flush=True)
                replay = {part: [[r["text"] for r in user] for user in out["before"][part]]
                          for part in ("users", "alone")} if out else None
                out[mode] = asyncio.run(ChatRun(args, api, pool).run(chats, alone, replay))
                if mode == "after":
                    out["text twin"] = asyncio.run(ChatRun(args, api, pool).run(twins, [], replay))
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


def later_costs(run: dict) -> dict[str, float]:
    """From turn 2 on, per answered turn: the frontend's CPU (ms), images decoded and left out, and the
    data-plane bytes (MB): pixels the frontend published, embeddings the language workers pulled."""
    turns = max(1, len(answered(run, slice(1, None))))
    later = run["later"]
    return {"frontend_cpu_ms": 1e3 * later.get("frontend.cpu_seconds", 0.0) / turns,
            "images_decoded": later.get("frontend.images_decoded", 0.0) / turns,
            "images_left_out": later.get("frontend.images_cached", 0.0) / turns,
            "pixel_mb": later.get("frontend.pixel_bytes_published", 0.0) / turns / 1e6,
            "embedding_mb": later.get("workers.embedding_bytes_pulled", 0.0) / turns / 1e6}


def mismatches(runs: dict[str, dict], turns: slice, part: str = "users") -> tuple[int, int]:
    """(turns of this slice whose answers differ or are missing in one run, turns compared) among the
    ``part``'s chats: the prompts are the same in both runs (the second replays the first's histories)."""
    before, after = (runs[m][part] for m in MODES)
    pairs = [(a[t] if t < len(a) else None, b[t] if t < len(b) else None)
             for a, b in zip(after, before) for t in range(max(len(a), len(b)))[turns]]
    return sum(x is None or y is None or x["text"] != y["text"] for x, y in pairs), len(pairs)


def summarize(args, runs: dict[str, dict]) -> dict:
    turns = {mode: per_turn(run, args.turns) for mode, run in runs.items()}
    later = {mode: mean_ttft_ms(answered(run, slice(1, None))) for mode, run in runs.items()}
    differ, compared = mismatches(runs, slice(None))
    first_differ, first_compared = mismatches(runs, slice(0, 1))
    alone_differ, alone_compared = mismatches(runs, slice(None), "alone")
    failed = sum(not r["ok"] for run in runs.values() for part in ("users", "alone") for u in run[part] for r in u)
    return {"turns": turns, "later_ttft_ms": later, "ratio": later["before"] / later["after"],
            "over_text": later["after"] / later["text twin"], "costs": {m: later_costs(runs[m]) for m in MODES},
            "mismatches": differ, "compared": compared, "first_turn_mismatches": first_differ,
            "first_turns": first_compared, "alone_mismatches": alone_differ, "alone_compared": alone_compared,
            "failed": failed, "counters": {m: runs[m]["counters"] for m in runs}}


def report(args, meta: dict, summary: dict) -> str:
    before = {"no-prefix-routing": "before: no prefix routing",
              "no-caching": "before: no prefix caching", "none": "before: the defaults too (a control)"}[args.baseline]
    lines = [f"Hardware: {meta['hardware']}", f"Versions: {json.dumps(meta['versions'])}",
             f"Command: {' '.join(meta['command'])}", f"Wall time: {meta['wall_s']:.0f} s", "",
             f"{args.users} users × {args.turns} turns, 2–5 × {args.image_resolution} images in the first turn, "
             f"{args.input_len} new text tokens a turn, {args.max_tokens} out (greedy, ignore_eos); topology "
             f"{args.topology} (`epd up {' '.join(args.layout.args)}`), {meta['model']}; {before}.", "",
             "| turn | prompt tokens (text twin) | TTFT after (ms) | before (ms) | × lower | text twin (ms) "
             "| after / twin | cached share after (usage) |", "|---|---|---|---|---|---|---|---|"]
    t = summary["turns"]
    for on, off, twin in zip(t["after"], t["before"], t["text twin"]):
        lines.append(f"| {on['turn']} | {on['prompt_tokens']:.0f} ({twin['prompt_tokens']:.0f}) | "
                     f"{on['ttft_ms']:.0f} | {off['ttft_ms']:.0f} | {off['ttft_ms'] / on['ttft_ms']:.2f} | "
                     f"{twin['ttft_ms']:.0f} | {on['ttft_ms'] / twin['ttft_ms']:.2f} | {on['cached_share']:.0%} |")
    later, costs = summary["later_ttft_ms"], summary["costs"]
    lines += ["", "| from turn 2 on, per turn | before | after |", "|---|---|---|"]
    for key, label, form in (("frontend_cpu_ms", "frontend CPU (ms)", ".1f"),
                             ("images_decoded", "images decoded", ".2f"),
                             ("images_left_out", "images left out (cached at the worker)", ".2f"),
                             ("pixel_mb", "pixels published (MB)", ".1f"),
                             ("embedding_mb", "embeddings pulled by LM workers (MB)", ".1f")):
        lines.append(f"| {label} | {costs['before'][key]:{form}} | {costs['after'][key]:{form}} |")
    counters = "; ".join(f"{m}: {c.get('hits', 0):.0f} of {c.get('queries', 0):.0f} prompt tokens"
                         for m, c in summary["counters"].items())
    lines += ["", f"Turns ≥ 2: mean TTFT {later['after']:.0f} ms after, {later['before']:.0f} ms before "
              f"({summary['ratio']:.2f}× lower), {later['text twin']:.0f} ms for the text twins (after "
              f"{summary['over_text']:.2f}× theirs). Workers' prefix-cache hits: {counters}. "
              f"Failed requests: {summary['failed']}.",
              f"Same outputs before and after (the same prompts: the second run replays the first's histories): "
              f"{summary['mismatches']} of {summary['compared']} turns differ — "
              f"{'yes' if summary['mismatches'] == 0 else 'no'}; of them in turn 1, which neither setting touches "
              f"(only the batches around each prompt differ): {summary['first_turn_mismatches']} of "
              f"{summary['first_turns']}.",
              f"Same outputs before and after, each turn alone on the stack ({args.alone_users} more chats, one turn "
              f"at a time): {summary['alone_mismatches']} of {summary['alone_compared']} turns differ — "
              f"{'yes' if summary['alone_compared'] and summary['alone_mismatches'] == 0 else 'no'}."]
    if args.baseline == "no-prefix-routing":
        lines.append(f"TTFT from turn 2 on ≤ {TEXT_TARGET:g}× the text twins': measured "
                     f"{summary['over_text']:.2f}× — {'yes' if summary['over_text'] <= TEXT_TARGET else 'no'}")
    elif args.baseline == "no-caching":
        lines.append(f"TTFT from turn 2 on ≥ {CACHING_TARGET:g}× lower with prefix caching: measured "
                     f"{summary['ratio']:.2f}× — {'yes' if summary['ratio'] >= CACHING_TARGET else 'no'}")
    return "\n".join(lines) + "\n"


def dry_run(args, chats: list[Conversation]) -> int:
    """What would run (the chats drawn without the tokenizer: the same image counts)."""
    print(f"{args.users} users × {args.turns} turns at once, {args.input_len} text tokens new a turn, "
          f"{args.max_tokens} out; images {args.image_resolution}, per user: "
          + " ".join(str(len(c.image_ids)) for c in chats[:-1]) + f"; seed {args.seed}; one warm-up chat first")
    for mode in MODES:
        env = " ".join(f"{k}={v}" for k, v in BASELINES[args.baseline].items()) if mode == "before" else "(defaults)"
        print(f"stack {mode:6} {env} python -m launcher.cli up --port 0 {' '.join(args.layout.args)}")
    print(f"then on each stack: {args.alone_users} more chats, one turn at a time, alone on the stack")
    print("then on the after stack: each user's text twin (its images as text of their token count)")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/multi_turn_chat", help="directory for results")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on the built-in tiny model")
    parser.add_argument("--dry-run", action="store_true", help="print what would run")
    parser.add_argument("--topology", default="aggregated", help="a layout label of bench/epd_vs_aggregated.py "
                        "(aggregated, E/PD, E/PD+MPS, E/P/D, E/P/D+MPS, ...)")
    parser.add_argument("--baseline", default="no-prefix-routing", choices=sorted(BASELINES),
                        help="what the \"before\" stack runs without (see above)")
    for name, kind in (("users", int), ("turns", int), ("max-tokens", int), ("input-len", int),
                       ("image-resolution", str), ("alone-users", int)):
        parser.add_argument(f"--{name}", type=kind, help="default: 16 / 6 / 64 / 64 / 1080p / 2 (tiny: 3 / 3 / 8 / "
                                                         "16 / 224x224 / 1)")
    parser.add_argument("--model", default="qwen2.5-vl-7b", choices=sorted(PRESETS), help="preset, dummy weights")
    parser.add_argument("--kv-cache-mb", type=int, default=0, help="KV pool of every LM process (MiB; 0: sized "
                                                                   "from the GPU's share, as a user's stack is)")
    parser.add_argument("--max-batched-tokens", type=int, default=0,
                        help="every LM worker's step budget (EPD_MAX_BATCHED_TOKENS; 0: the engine's default)")
    parser.add_argument("--transport", default="auto", choices=("auto", "zmq", "ucx"))
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds one turn may take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.tiny].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if min(args.users, args.turns, args.max_tokens, args.input_len) < 1 or args.alone_users < 0:
        parser.error("--users, --turns, --max-tokens and --input-len must be at least 1, --alone-users at least 0")
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
        return dry_run(args, conversations(args, PromptWriter())[:args.users + 1])
    started = time.monotonic()
    tokenizer = tokenizer_dir(args.tiny, args.model)
    writer = PromptWriter(tokenizer)
    drawn = conversations(args, writer)
    chats, alone = drawn[:args.users + 1], drawn[args.users + 1:]
    pool = ImagePool(parse_resolution(args.image_resolution), "jpeg", args.seed)
    pool.generate(sum(len(c.image_ids) for c in drawn))
    width, height = pool.size
    twins = text_twins(chats, ImageGeometry.from_checkpoint(tokenizer).num_tokens(height, width), writer, args.seed)
    runs = run_modes(args, pool, chats, alone, twins)
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
