"""Token ids to the text a client receives: `TextStream` (deltas, whole characters only, stop
sequences found across tokens and steps)."""
from __future__ import annotations

from typing import List, Optional

#: What a tokenizer's decode gives for bytes that do not (yet) make a whole UTF-8 character.
PLACEHOLDER = "\ufffd"


class TextStream:
    """Token ids in, text out, incrementally: the text of every token so far (special tokens
    skipped), handed out as deltas; a character split across tokens is held back until complete
    (and left out when the answer ends inside it), and so is the tail that could still become a
    stop sequence. `feed` returns (delta, stopped).

    The text ends where the earliest of the stop sequences starts (after it, with
    `include_stop`: vLLM's ``include_stop_str_in_output``), whichever of them it is and however
    many tokens a step delivered (one at a time or a Medusa step's several give the same text);
    `used` is then the number of tokens up to the one that completed it (the usage's
    completion_tokens: tokens the engine made after it are not the answer's). Stop sequences are
    looked for only in whole characters, so a stop of U+FFFD does not match a character whose
    bytes are still coming."""

    def __init__(self, tokenizer, stop: List[str], include_stop: bool = False):
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.tokens: List[int] = []
        self.sent = 0
        self.text = ""
        self.used: Optional[int] = None
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _stop_at(self, text: str) -> Optional[int]:
        """Where the text ends at the earliest stop sequence in `text` (past what was already
        sent): its start, or its end with `include_stop`; None without one."""
        found = [(i, -len(s)) for s in self.stop for i in (text.find(s, max(self.sent - len(s) + 1, 0)),) if i >= 0]
        if not found:
            return None
        i, minus_len = min(found)  # the earliest; at one start, the longest
        return i - minus_len if self.include_stop else i

    def _decode(self, tokens: List[int]) -> str:
        """The text of `tokens`, less a last character whose bytes are not all out yet. No clean-up
        of spaces before punctuation (some tokenizers' default): with it, the text of n + 1 tokens
        need not extend the text of n ("it '" + "s" -> "it's"), which a stream relies on."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text.rstrip(PLACEHOLDER)

    def feed(self, tokens: List[int], final: bool = False) -> tuple:
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self._decode(self.tokens)  # a character the answer ends inside is not part of it
        i = self._stop_at(text)
        if i is not None:
            self.used = next(n for n in range(before + 1, len(self.tokens) + 1)
                             if self._stop_at(self._decode(self.tokens[:n])) is not None)
            self.text = text[:i]
            delta, self.sent = self.text[self.sent:], max(len(self.text), self.sent)
            return delta, True
        end = len(text) if final else max(len(text) - self.hold, self.sent)
        self.text = text
        delta, self.sent = text[self.sent:end], max(end, self.sent)
        return delta, False
