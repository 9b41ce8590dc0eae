"""Token ids to the text a client receives: `TextStream` (deltas, whole characters only, stop
sequences found across tokens and steps), and each token's own bytes and text for log-probabilities
(`TokenPieces`, `TextOffsets`)."""
from __future__ import annotations

import codecs
import json
import re
from typing import Dict, FrozenSet, List, Optional, Sequence

#: What a tokenizer's decode gives for bytes that do not (yet) make a whole UTF-8 character.
PLACEHOLDER = "\ufffd"
#: How many of a completion prompt's last tokens an answer's text is decoded after (`TextStream`'s
#: ``after``; vLLM's detokenizer starts from the prompt's last 5 or 6).
AFTER_TOKENS = 6


class TextStream:
    """Token ids in, text out, incrementally: the text of every token so far (special tokens
    skipped), handed out as deltas; a character split across tokens is held back until complete
    (and left out when the answer ends inside it), and so is the tail that could still become a
    stop sequence. `feed` returns (delta, stopped).

    Stop sequences are found as vLLM finds them one token at a time, however many tokens a step
    delivered (one, or a Medusa step's several, give the same text): the first token whose text
    completes one ends the answer, at the first stop of the list found in the text that token
    added; the text ends where that stop starts (after it, with `include_stop`: vLLM's
    ``include_stop_str_in_output``), and `used` counts the tokens up to that one (the usage's
    completion_tokens: tokens the engine made after it are not the answer's). Stops are looked for
    only in whole characters, so a stop of U+FFFD does not match a character whose bytes are still
    coming. `hidden_ids` (a request's stop token ids) end the answer without their text unless
    `include_stop` (vLLM leaves a stop token's text out; special tokens have none anyway). As in
    vLLM, a stop sequence completed by one of the first `min_tokens` tokens does not count.
    `keep_ids`: special tokens whose text the text keeps (a tool-call parser's markers, such as
    Mistral's ``[TOOL_CALLS]``), among `special_ids` (all the special tokens: `TokenPieces.special`).
    `after`: the token ids the answer continues (a completion prompt's last few, up to a character
    it ends inside): the text is what the answer's tokens add to theirs, as vLLM's detokenizer reads
    it. Decoded alone, an answer would lose its first word's space on a SentencePiece vocabulary
    (Llama 2's, Mistral's: the decoder drops the space a text starts with, so "The capital is" +
    "▁Paris" is " Paris", not "Paris"); byte-level vocabularies give the same text either way."""

    def __init__(self, tokenizer, stop: List[str], include_stop: bool = False, hidden_ids=(), min_tokens: int = 0,
                 keep_ids: FrozenSet[int] = frozenset(), special_ids: FrozenSet[int] = frozenset(),
                 after: Sequence[int] = ()):
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.min_tokens = min_tokens
        self.keep, self.special = frozenset(keep_ids), frozenset(special_ids)
        self.hidden = frozenset(() if include_stop else hidden_ids)
        self.tokens: List[int] = []
        self.sent = 0     # characters handed out
        self.checked = 0  # characters of the text already searched for stops (up to the last token)
        self.text = ""
        self.used: Optional[int] = None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.after = [int(t) for t in after]
        self.after_text = self._raw(self.after) if self.after else ""
        while self.after and self.after_text.endswith(PLACEHOLDER):  # a prompt ending inside a character:
            self.after.pop()  # from before it (its bytes would swallow an answer byte that finishes it)
            self.after_text = self._raw(self.after)

    def _stop_at(self, text: str, since: int) -> Optional[int]:
        """Where the text ends for the first stop in the list that occurs in `text` ending past
        character `since` (its start, or its end with `include_stop`); None without one."""
        for s in self.stop:
            i = text.find(s, max(since - len(s) + 1, 0))
            if i >= 0:
                return i + len(s) if self.include_stop else i
        return None

    def _decode(self, tokens: List[int]) -> str:
        """The text of `tokens`, less a last character whose bytes are not all out yet. No clean-up
        of spaces before punctuation (some tokenizers' default): with it, the text of n + 1 tokens
        need not extend the text of n ("it '" + "s" -> "it's"), which a stream relies on."""
        if self.hidden:
            tokens = [t for t in tokens if t not in self.hidden]
        if self.after and tokens:
            joined = self._raw(self.after + tokens)
            if joined.startswith(self.after_text):  # (not when the prompt ends inside a character)
                return joined[len(self.after_text):].rstrip(PLACEHOLDER)
        return self._raw(tokens).rstrip(PLACEHOLDER)

    def _raw(self, tokens: List[int]) -> str:
        if self.keep:  # the special tokens left out here, but for those kept
            tokens = [t for t in tokens if t in self.keep or t not in self.special]
        return self.tokenizer.decode(tokens, skip_special_tokens=not self.keep, clean_up_tokenization_spaces=False)

    def feed(self, tokens: List[int], final: bool = False) -> tuple:
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self._decode(self.tokens)  # a character the answer ends inside is not part of it
        if self._stop_at(text, self.checked) is not None:  # then token by token, as one at a time finds it
            since = self.checked
            for n in range(before + 1, len(self.tokens) + 1):
                upto = text if n == len(self.tokens) else self._decode(self.tokens[:n])
                end = self._stop_at(upto, since) if n > self.min_tokens else None
                if end is not None:
                    self.used, self.text = n, upto[:end]
                    delta, self.sent = self.text[self.sent:], max(len(self.text), self.sent)
                    return delta, True
                since = len(upto)
        self.checked = len(text)
        end = len(text) if final else max(len(text) - self.hold, self.sent)
        self.text = text
        delta, self.sent = text[self.sent:end], max(end, self.sent)
        return delta, False


class TokenPieces:
    """Each token's own bytes and text, as a logprobs object gives them (OpenAI's ``token`` and
    ``bytes``): the bytes the token stands for, so that a character split across tokens (an emoji,
    most CJK text) is rebuilt by joining them, where decoding one token alone gives U+FFFD.

    Byte-level BPE vocabularies (GPT-2's, Llama 3's, Qwen's, SmolLM's: a ``ByteLevel`` decoder) map
    each byte to a printable character, undone here with transformers' `bytes_to_unicode`;
    SentencePiece's byte tokens ``<0xNN>`` are that byte and its ``▁`` a space. Special and added
    tokens are their own text. The text is the bytes as UTF-8, an incomplete character's bytes
    written as ``\\xNN`` escapes (so distinct tokens keep distinct texts)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: Dict[int, bytes] = {}
        # the tokens a decode with skip_special_tokens leaves out: the named special tokens, and every
        # added token marked special (chat and tool markers that the tokenizer does not name)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special = frozenset(set(getattr(tokenizer, "all_special_ids", ()) or ())
                                 | {i for i, t in added.items() if getattr(t, "special", False)})
        self.byte_level = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {} if backend is not None else {}
        except (ValueError, AttributeError):
            decoder = {}
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or ()]
        if "ByteLevel" in kinds:
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            self.byte_level = {c: b for b, c in bytes_to_unicode().items()}

    def bytes(self, token: int) -> bytes:
        out = self.cache.get(token)
        if out is None:
            out = self.cache[token] = self._bytes(token)
        return out

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        if piece is None:
            return b""
        if token in self.special:
            return piece.encode("utf-8")
        if self.byte_level is not None and all(c in self.byte_level for c in piece):
            return bytes(self.byte_level[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level is None and "\u2581" in piece:  # SentencePiece's space
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([int(token)], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False).encode("utf-8")

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="backslashreplace")


class TextOffsets:
    """Where each token's text starts in an answer's text (the legacy ``text_offset``): characters
    decoded before it, a character split across tokens counted from the token that starts it, and
    bytes that a later token does not continue counted as the U+FFFD they decode to. Special tokens
    (which an answer's text leaves out) add nothing, unless `specials` (a text that keeps them: an
    echoed prompt given as token ids). `start`: the characters before the first token."""

    def __init__(self, pieces: TokenPieces, start: int = 0, specials: bool = False):
        self.pieces, self.specials = pieces, specials
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start

    def next(self, token: int) -> int:
        at = self.chars
        if token in self.pieces.special and not self.specials:
            return at
        data = self.pieces.bytes(token)
        pending = self.decoder.getstate()[0]  # an earlier token's bytes of a character not yet whole
        if pending and data and not 0x80 <= data[0] <= 0xBF:  # not continued: they end as U+FFFD before it
            at += len(pending.decode("utf-8", errors="replace"))
        self.chars += len(self.decoder.decode(data))
        return at


def marker_ids(tokenizer, pieces: TokenPieces, markers) -> FrozenSet[int]:
    """The ids of the special tokens among `markers` (token texts, a tool-call parser's) that the
    tokenizer has (`TextStream`'s ``keep_ids``)."""
    out = set()
    for m in markers:
        i = tokenizer.convert_tokens_to_ids(m)
        if isinstance(i, int) and i in pieces.special and tokenizer.convert_ids_to_tokens(i) == m:
            out.add(i)
    return frozenset(out)


def bad_words_ids(tokenizer, words: List[str]) -> List[List[int]]:
    """The token id sequences of vLLM's ``bad_words`` (``SamplingParams.update_from_tokenizer``): each
    word (its leading spaces stripped) as it would start the text, and, when that gives another first
    token and as many tokens, after a space (as within the text)."""
    out: List[List[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [w for w in out if w]
