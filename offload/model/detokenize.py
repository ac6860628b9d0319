"""A request's output tokens turned into text as they arrive, and the stop strings found in it.

`TextStream` takes one token at a time and hands out text deltas whose concatenation is the final text:
- Incremental decoding decodes a short window of the latest tokens, not the whole output each time: the text
  of ids[prefix:] minus the text of ids[prefix:read] is what the tokens after `read` add. A window that ends
  inside a multi-byte character (the decode ends in U+FFFD) waits for the next token.
- A stop string ends the text before it. Until the request finishes, a tail of the text that could still
  grow into a stop string is held back, so no delta ever shows text that the final answer cuts.
Without `incremental`, only the stop-string check runs per token (on a window of the last tokens) and the text
is decoded once, whole, when the request finishes: what a caller that only wants the final text pays.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decode of a partial UTF-8 sequence ends with
STOP_SLACK = 8  # tokens beyond a stop string's length in the checking window (byte-level pieces)


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str], incremental: bool) -> None:
        self._tokenizer = tokenizer  # transformers.PreTrainedTokenizerBase
        self._stops = tuple(stops)
        self._longest = max(map(len, self._stops), default=0)  # characters
        self._incremental = incremental
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window, into _ids
        self._read = 0  # tokens already turned into text
        self._text = ""  # decoded so far, cut at a stop string once one is found
        self._sent = 0  # characters of _text handed out
        self.stopped = False  # a stop string was found; the text ends before it

    def push(self, token_id: int) -> None:
        """Add the next output token (not after a stop string was found)."""
        self._ids.append(token_id)
        if self._incremental:
            grown = len(self._text)
            self._decode_window(final=False)
            self._find_stop(max(0, grown - self._longest + 1))
        elif self._stops:
            tail = self._decode(self._ids[-(self._longest + STOP_SLACK) :])
            self.stopped = any(s in tail for s in self._stops)

    def take(self, final: bool) -> str:
        """The text not handed out yet that is safe to show: all of it once `final` (the request finished)."""
        if final:
            if self._incremental:
                self._decode_window(final=True)
            else:
                self._text = self._decode(self._ids)
            self._find_stop(0)
            end = len(self._text)
        else:
            end = len(self._text) if self.stopped else len(self._text) - self._held()
        delta = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_window(self, final: bool) -> None:
        if self.stopped or self._read == len(self._ids):
            return
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT)):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)

    def _find_stop(self, start: int) -> None:
        """Cut the text at the first stop string that begins at or after `start` (characters)."""
        if self.stopped and self._incremental:
            return
        found = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self._text = self._text[: min(found)]
            self.stopped = True

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string: they may yet complete it."""
        for k in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
