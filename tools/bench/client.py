"""One streamed chat completion, timed from the SSE chunks as they arrive.

TTFT is the time to the first chunk that carries text (the role chunk a server sends before any token is
not a token); ITL the gaps between text chunks; E2E the time to the end of the stream. Token counts come
from the usage chunk (``stream_options.include_usage``), or are the number of text chunks when a server
sends none. The answer's text and the prompt tokens a prefix cache served (``usage.prompt_tokens_details``)
are kept too, for benchmarks that carry a conversation on or compare answers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from tools.bench.dataset import RequestSpec


@dataclass
class RequestResult:
    index: int
    kind: str  # "text" | "image" | "video"
    images: int
    ok: bool = False
    videos: int = 0
    error: str = ""
    sent_at: float = 0.0  # seconds since the run began
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served
    text: str = ""  # the answer; not in record(): a sweep's JSON would carry every answer

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for a single token)."""
        return (self.e2e - self.ttft) / (self.completion_tokens - 1) if self.completion_tokens > 1 else 0.0

    def record(self) -> dict:
        out = {**asdict(self), "tpot": self.tpot}
        del out["text"]
        return out


def request_body(model: str, messages: list[dict], request: RequestSpec, ignore_eos: bool) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": request.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, spec: RequestSpec, t0: float) -> RequestResult:
    result = RequestResult(spec.index, spec.kind, len(spec.image_ids), videos=len(spec.video_ids))
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    result.sent_at = start - t0
    try:
        async with client.stream("POST", url, content=payload, headers={"Content-Type": "application/json"}) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                return result
            await _read_stream(resp, result, start)
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def _read_stream(resp: httpx.Response, result: RequestResult, start: float) -> None:
    last = None
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            result.error = str(chunk["error"].get("message", chunk["error"]))[:300]
            return
        now = time.perf_counter()
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text or (choice.get("finish_reason") and last is None):
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += bool(text)
                result.text += text or ""
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            result.completion_tokens = chunk["usage"].get("completion_tokens", 0)
            result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    result.e2e = time.perf_counter() - start
    if not result.completion_tokens:
        result.completion_tokens = chunks
    if last is None:
        result.error = "the stream ended without a token"
        return
    result.ok = bool(result.finish_reason)
    if not result.ok:
        result.error = "the stream ended without a finish reason"
