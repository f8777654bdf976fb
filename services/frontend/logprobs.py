"""Token logprobs as OpenAI formats them: chat's ``logprobs.content`` entries (token, logprob, bytes,
top_logprobs) and the legacy completions lists (tokens, token_logprobs, top_logprobs, text_offset).

A token's ``bytes`` are its own bytes (a byte-level BPE token may hold part of a character); its
``token`` string is those bytes as text, or vLLM's ``bytes:\\xNN…`` spelling when they are not UTF-8.
"""

from __future__ import annotations

from functools import lru_cache

from services.frontend.protocol import ChoiceLogprobs, TokenLogprobEntry, TopLogprob
from services.frontend.text_protocol import CompletionLogprobs
from shared.messages.stream import TokenLogprob


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is spelled with."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Per-token bytes and display strings of one tokenizer, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decoder = _byte_decoder()
        self.bytes_of = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in self._decoder for c in piece):
            return bytes(self._decoder[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def text(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    # -- chat ---------------------------------------------------------------------------------------
    def entry(self, token_id: int, lp: TokenLogprob) -> TokenLogprobEntry:
        return TokenLogprobEntry(token=self.text(token_id), logprob=lp.logprob, bytes=list(self.bytes_of(token_id)),
                                 top_logprobs=[TopLogprob(token=self.text(t), logprob=v, bytes=list(self.bytes_of(t)))
                                               for t, v in zip(lp.top_ids, lp.top_logprobs)])

    def chat(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
        if logprobs is None:
            return None
        return ChoiceLogprobs(content=[self.entry(t, lp) for t, lp in zip(token_ids, logprobs)])

    # -- legacy completions -------------------------------------------------------------------------
    def completion(self, token_ids: list[int], logprobs: list[TokenLogprob | None], offset: int,
                   out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """Append the tokens to ``out`` (a new one if None); ``offset``: text offset of the first."""
        out = out or CompletionLogprobs()
        for token, lp in zip(token_ids, logprobs):
            text = self.text(token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {self.text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)})
        return out
