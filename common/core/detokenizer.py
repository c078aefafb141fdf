"""Token ids -> streamed text, one token at a time, with stop strings.

Incremental decoding (the prefix-offset / read-offset technique):

    ids:  ... [prefix_offset, read_offset)  [read_offset, len(ids))
               already emitted, decoded     new tokens
               again only as context

Each step decodes two short windows, `ids[prefix_offset:read_offset]` and
`ids[prefix_offset:]`, and emits the difference of the two texts. The context window
matters for tokenizers whose decode depends on the neighbour (SentencePiece drops the
leading space of a sequence's first token). When the new text ends in U+FFFD the last
token stopped inside a multi-byte UTF-8 character (byte-level BPE splits 'é', '日',
emoji over several tokens): nothing is emitted and the offsets stay, so the next token
completes the character. Cost per token: two decodes of a few tokens, never the whole
sequence. The window starts 5 tokens into the prompt's tail so the first generated
token is decoded in context; a window starting inside a character decodes the same
stray bytes in both texts, so they cancel out of the difference.

Stop strings are matched on the decoded text, across token boundaries. The earliest
match in the text wins (same start: the shorter, which completes first); the stop
string and everything after it never reach the client. Text that could still be the
beginning of a stop string (the longest suffix that is a proper prefix of one, at most
max(len(stop)) - 1 characters) is held back until it either completes the stop string
or stops matching, so a client never sees text that later gets retracted. `flush()`
releases what is held at the end (length or EOS).

The output text is that of the generated ids decoded in the context of the prompt; for
byte-level BPE this equals `tokenizer.decode(generated_ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
_PROMPT_CONTEXT = 5  # prompt tokens decoded as context before the first new token


class Tokenizer(Protocol):
    """What the detokenizer needs: HF tokenizers and `tokenizers.Tokenizer` both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of one sequence, grown one token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(stop)
        # As vLLM: no stop string is looked for before `min_tokens` tokens were
        # generated; from then on, only in the text that arrives (text emitted before
        # cannot be taken back, so a stop string that began before the boundary does
        # not match).
        self._min_tokens = min_tokens
        # Only the prompt's tail is kept: it is decoding context, never output.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # decoded, complete text not yet emitted (may start a stop)
        self._chunks: list[str] = []  # emitted so far, joined on demand (no O(n^2) +=)
        self.stop_reason: str | None = None  # the stop string matched, once matched
        self.num_tokens = 0  # generated tokens added

    @property
    def text(self) -> str:
        """Emitted text so far, the stop string excluded."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text that may be emitted now."""
        if self.stopped:
            raise RuntimeError(
                f"add() after the sequence stopped on stop string {self.stop_reason!r}"
            )
        self._ids.append(token_id)
        self.num_tokens += 1
        return self._emit(self._decode_new(), final=False)

    def flush(self) -> str:
        """At the end (length, EOS, stop token): release all held-back text."""
        if self.stopped:
            return ""
        tail = self._decode_window()[1]  # may end in U+FFFD: decode(all) would too
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        return self._emit(tail, final=True)

    def _decode_window(self) -> tuple[str, str]:
        """(text of the context window, text of the tokens after it)."""
        decode = self._tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset],
            skip_special_tokens=self._skip_special,
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        return prefix, full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode_new(self) -> str:
        """The text the new tokens complete; "" while a character is still incomplete."""
        _, new = self._decode_window()
        if new.endswith(_REPLACEMENT):
            return ""
        if new:
            self._prefix_offset = self._read_offset
        else:  # decoded to nothing (a skipped special token): consume it, keep context,
            # and keep the window short however many such tokens come in a row
            self._prefix_offset = max(self._prefix_offset, len(self._ids) - _PROMPT_CONTEXT)
        self._read_offset = len(self._ids)
        return new

    def _emit(self, new: str, *, final: bool) -> str:
        """Run `new` through the stop strings; return what the client may see now."""
        buf = self._held + new
        if self.num_tokens < self._min_tokens:  # stop strings not looked for yet
            if buf:
                self._chunks.append(buf)
            self._held = ""
            return buf
        match = self._find_stop(buf)
        if match is not None:
            start, stop = match
            self.stop_reason = stop
            out, self._held = buf[:start], ""
        else:
            hold = 0 if final else self._hold_length(buf)
            out, self._held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        if out:
            self._chunks.append(out)
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """Earliest (start, stop string) in buf; on the same start the shorter one."""
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        return None if best is None else (best[0], best[2])

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string.

        Per stop string, candidate starts are the places its first character occurs in
        the last len(stop) - 1 characters; the earliest that matches is the longest."""
        hold = 0
        for s in self._stops:
            i = buf.find(s[0], max(0, len(buf) - len(s) + 1))
            while i != -1:
                if s.startswith(buf[i:]):
                    hold = max(hold, len(buf) - i)
                    break
                i = buf.find(s[0], i + 1)
        return hold
