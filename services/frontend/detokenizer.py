"""Incremental detokenization with stop strings.

The text streamed to a client, concatenated, is exactly ``tokenizer.decode(all_output_ids)`` (cut at
the first stop string). Tokens decode in a short window (``prefix``..end) and only text that can no
longer change is released: a window ending in U+FFFD (a multi-byte character split across tokens) is
held until the character completes, and the last ``longest stop − 1`` characters are held until it
is clear they do not start a stop string. ``include_stop``: the text ends after the stop string
instead of before it (``stop_reason`` names the string either way).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.stop_reason: str | None = None  # the stop string found
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # settled text: whole characters only
        self.emitted = 0  # characters of ``text`` already released
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of ``text``
        self._read = 0
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        self.ids += token_ids
        head = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(head) and not window.endswith(REPLACEMENT):
            self.text += window[len(head):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once no more tokens come."""
        if not self.stopped:
            self.text = self._decode(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = self._find_stop()
        if found is not None:
            cut, self.stop_reason = found
            self.text = self.text[:cut + (len(self.stop_reason) if self.include_stop else 0)]
            self.stopped = True
            final = True
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        if not self.stop or self.stopped:
            return None
        start = max(0, self.emitted - self.hold)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""
