"""Incremental detokenization and stop strings.

Token ids arrive a few at a time; text must leave as soon as it is final.
Two things make that subtle:

* A byte-level BPE splits one character ("é", an emoji) into several byte
  tokens. Decoding a prefix of them yields U+FFFD, which a stream must never
  show and later take back. Both decoders below hold text back while it ends
  in U+FFFD and release it once the character completes.
* A stop string can be split across tokens ("ST" + "OP"), so each check looks
  at the new text plus the `len(stop) - 1` characters before it; and a stream
  holds back any tail that could still grow into a stop string, so a client
  never sees a piece of text that is later cut.

Two decoders, one interface:

* `FastIncrementalDetokenizer` drives `tokenizers.decoders.DecodeStream`
  (Rust) over the HF fast tokenizer's backend: a few microseconds a token.
* `SlowIncrementalDetokenizer` is vLLM's prefix/read-offset algorithm over
  `convert_ids_to_tokens` + `convert_tokens_to_string`, for tokenizers with
  no Rust backend.

Both keep `text-so-far == decode(ids-so-far)` up to characters still pending,
and `flush()` returns those (as U+FFFD if they never completed), so the final
text of a sequence equals the tokenizer's own `decode` of its ids.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayvllm.messages.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "RequestDetokenizer",
    "SlowIncrementalDetokenizer",
    "TokenizerInfo",
    "check_stop_strings",
    "make_incremental_detokenizer",
    "partial_stop_length",
]

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens fed to a decoder before the first output token. Some decoders
# (SentencePiece's Metaspace) decide a token's leading space from what comes
# before it, so the first output token needs a little of the prompt as context.
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24
# The slow decoder drops tokens older than its prefix offset once this many
# pile up, so a long generation keeps O(1) live token strings.
_SLOW_TRIM_THRESHOLD = 64

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21: fall back to the Python algorithm
    _DecodeStream = None  # type: ignore[assignment,misc]


@dataclass
class TokenizerInfo:
    """Facts about a tokenizer that per-token code needs, computed once.

    HF recomputes properties such as `added_tokens_decoder` on every access,
    which is too slow to touch per request, so they are cached here per
    tokenizer object (weakly, so a dropped tokenizer is freed).
    """

    is_fast: bool
    backend: Any | None  # tokenizers.Tokenizer, when is_fast
    added_tokens: dict[int, str]  # id -> content, for every added token
    added_vocab: dict[str, int]  # content -> id
    special_ids: frozenset[int]

    @classmethod
    def of(cls, tokenizer: "PreTrainedTokenizerBase") -> "TokenizerInfo":
        cache = _TOKENIZER_INFO
        try:
            return cache[tokenizer]
        except (KeyError, TypeError):
            pass
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        added = {int(i): str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        info = cls(
            is_fast=backend is not None,
            backend=backend,
            added_tokens=added,
            added_vocab={content: i for i, content in added.items()},
            special_ids=frozenset(getattr(tokenizer, "all_special_ids", ()) or ()),
        )
        try:
            cache[tokenizer] = info
        except TypeError:
            pass  # not weak-referenceable: recompute next time, still correct
        return info


_TOKENIZER_INFO: "weakref.WeakKeyDictionary[Any, TokenizerInfo]" = weakref.WeakKeyDictionary()


class IncrementalDetokenizer(ABC):
    """Turns token ids, one at a time, into text.

    Invariant: the concatenation of everything `decode_next` and `flush`
    returned is the text of all ids seen, never revised; text is withheld
    (returned later) while it would end in a partial character.
    """

    @abstractmethod
    def decode_next(self, token_id: int) -> str:
        """Text that `token_id` makes final; "" while a character is pending."""

    @abstractmethod
    def flush(self) -> str:
        """Text still pending (incomplete characters decode as U+FFFD)."""


def _clean_prompt_context(
    decode: Any, prompt_token_ids: Sequence[int]
) -> list[int]:
    """Shortest prompt suffix (4..24 tokens) that decodes without U+FFFD.

    A suffix that starts or ends mid-character would make the decoder's prefix
    text wrong, so such suffixes are skipped; none clean means no context.
    """
    n = len(prompt_token_ids)
    if n == 0:
        return []
    if n <= _MIN_PROMPT_CONTEXT:
        suffix = list(prompt_token_ids)
        return suffix if _REPLACEMENT_CHAR not in decode(suffix) else []
    for length in range(_MIN_PROMPT_CONTEXT, min(n, _MAX_PROMPT_CONTEXT) + 1):
        suffix = list(prompt_token_ids[-length:])
        if _REPLACEMENT_CHAR not in decode(suffix):
            return suffix
    return []


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """`DecodeStream` over a fast tokenizer's Rust backend.

    Text equals `tokenizer.decode(ids, skip_special_tokens=...)`; HF fast
    tokenizers ignore `spaces_between_special_tokens`, and so does this class
    except for vLLM's rule that with it False two adjacent added tokens are
    joined by their raw contents (no space a decoder might put between them).
    """

    def __init__(
        self,
        info: TokenizerInfo,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        assert _DecodeStream is not None and info.backend is not None
        self._info = info
        self._backend = info.backend
        self._skip = skip_special_tokens
        self._raw_adjacent_added = not skip_special_tokens and not spaces_between_special_tokens
        self._last_was_added = False
        context = _clean_prompt_context(
            lambda ids: self._backend.decode(ids, skip_special_tokens=skip_special_tokens), prompt_token_ids
        )
        self._stream = _DecodeStream(context or None, skip_special_tokens)
        # Ids the stream has taken but not yet turned into text, so `flush`
        # can decode them; DecodeStream itself has no flush.
        self._pending: list[int] = []

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):
            # An id the tokenizer cannot even represent (negative, huge):
            # it has no text; keep the stream as it was.
            logger.warning("Cannot detokenize token id %r; emitting no text for it", token_id)
            return ""
        except Exception as e:  # tokenizers raises a plain Exception here
            if "invalid prefix" not in str(e).lower():
                raise
            # Some decoders produce text that is not monotonic in the ids,
            # which breaks DecodeStream's prefix bookkeeping. Restart the
            # stream at this token; pending partial characters are lost, as
            # in vLLM, rather than failing the request.
            logger.warning("DecodeStream lost its prefix; restarting it at token %d", token_id)
            self._pending.clear()
            self._stream = _DecodeStream(None, self._skip)
            return self._stream.step(self._backend, token_id)

    def decode_next(self, token_id: int) -> str:
        piece = self._step(token_id)
        if self._raw_adjacent_added:
            content = self._info.added_tokens.get(token_id)
            if content is not None and self._last_was_added and piece is not None:
                piece = content
            self._last_was_added = content is not None
        if piece is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return piece

    def flush(self) -> str:
        if not self._pending:
            return ""
        text = self._backend.decode(self._pending, skip_special_tokens=self._skip)
        self._pending.clear()
        # Restart so ids after a flush (none in normal use) decode standalone
        # instead of against a prefix that was already returned.
        self._stream = _DecodeStream(None, self._skip)
        return text


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """vLLM's prefix/read-offset algorithm over token strings.

    Keeps the token strings `tokens[prefix_offset:]`; each step decodes
    `tokens[prefix_offset:read_offset]` (text already returned) and
    `tokens[prefix_offset:]`, and returns the difference once it does not end
    in U+FFFD, then slides both offsets forward. Decoding a short window
    rather than one token alone keeps context-dependent spacing right.
    Added tokens are emitted verbatim and, as in HF slow tokenizers, joined
    to neighbouring text with a space when `spaces_between_special_tokens`.
    """

    _CONTEXT = 5

    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase",
        info: TokenizerInfo,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._info = info
        self._skip = skip_special_tokens
        self._sep = " " if spaces_between_special_tokens else ""
        self._tokens: list[str] = self._to_tokens(prompt_token_ids[-(self._CONTEXT + 1) :])
        self._prefix_offset = max(len(self._tokens) - self._CONTEXT, 0)
        self._read_offset = len(self._tokens)

    def _to_tokens(self, ids: Sequence[int]) -> list[str]:
        out: list[str] = []
        for token_id in ids:
            if self._skip and token_id in self._info.special_ids:
                continue
            try:
                token = self._tokenizer.convert_ids_to_tokens(int(token_id))
            except (IndexError, OverflowError, TypeError, ValueError):
                token = None
            if isinstance(token, str):  # None for ids the tokenizer does not know
                out.append(token)
        return out

    def _to_text(self, tokens: list[str]) -> str:
        added = self._info.added_vocab
        if not added:
            return self._tokenizer.convert_tokens_to_string(tokens)
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in added:
                if run:
                    pieces.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self._tokenizer.convert_tokens_to_string(run))
        return self._sep.join(pieces)

    def _advance(self) -> str:
        tokens = self._tokens
        prefix_text = self._to_text(tokens[self._prefix_offset : self._read_offset])
        new_text = self._to_text(tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(tokens)
        if self._prefix_offset > _SLOW_TRIM_THRESHOLD:
            del tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def decode_next(self, token_id: int) -> str:
        new_tokens = self._to_tokens((token_id,))
        if not new_tokens:
            return ""
        self._tokens.extend(new_tokens)
        return self._advance()

    def flush(self) -> str:
        if self._read_offset >= len(self._tokens):
            return ""
        prefix_text = self._to_text(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._to_text(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]


def make_incremental_detokenizer(
    tokenizer: "PreTrainedTokenizerBase",
    prompt_token_ids: Sequence[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    force_slow: bool = False,
) -> IncrementalDetokenizer:
    """The fast decoder when the tokenizer has a Rust backend, else the slow one."""
    info = TokenizerInfo.of(tokenizer)
    if info.is_fast and _DecodeStream is not None and not force_slow:
        return FastIncrementalDetokenizer(info, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens)
    return SlowIncrementalDetokenizer(
        tokenizer, info, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
    )


def check_stop_strings(
    output_text: str,
    new_char_count: int,
    stop: Sequence[str],
    include_in_output: bool,
) -> tuple[str, int] | None:
    """Find a stop string that ends in the last `new_char_count` characters.

    Only `output_text[-(new_char_count + len(s) - 1):]` is searched for each
    stop string `s`: older text was searched before, and a match must end in
    the new text. Among matches the one ending first wins (ties: the longer),
    which is what a character-by-character stream would have seen, so the
    result does not depend on how text was split into tokens.

    Returns (stop string, length to truncate the text to), or None.
    """
    if new_char_count <= 0 or not stop:
        return None
    text_len = len(output_text)
    best: tuple[str, int] | None = None
    best_end = 0
    for stop_str in stop:
        start = max(0, text_len - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        end = index + len(stop_str)
        if best is None or end < best_end or (end == best_end and index < best[1]):
            best, best_end = (stop_str, index), end
    if best is None:
        return None
    stop_str, index = best
    return stop_str, (index + len(stop_str) if include_in_output else index)


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string.

    That tail may still become a stop string and be cut, so a stream must not
    show it yet. Any later match must start inside this tail (older text
    was already checked), which is why holding back exactly this much is safe.
    """
    longest = 0
    for stop_str in stop:
        for k in range(min(len(stop_str) - 1, len(text)), longest, -1):
            if text.endswith(stop_str[:k]):
                longest = k
                break
    return longest


class RequestDetokenizer:
    """Text of one sequence: incremental decode, stop strings, streaming offsets.

    Invariants: `output_token_ids` holds every id the engine produced
    (including a stop token and ids after a stop string, as vLLM does);
    `output_text` only grows until a stop string cuts it, and the cut is
    never before `_sent_offset`, so a streamed prefix is never retracted.
    """

    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase",
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        force_slow: bool = False,
    ) -> None:
        self._decoder = make_incremental_detokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            force_slow=force_slow,
        )
        assert isinstance(params.stop, list)
        self.stop: list[str] = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # With the stop string kept in the output, every text before the cut
        # point survives, so nothing needs holding back.
        self._hold_back = bool(self.stop) and not self.include_stop_str_in_output
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self._sent_offset = 0
        self._finished = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool, final: bool = False) -> str | None:
        """Decode `new_token_ids`, then look for stop strings.

        `stop_terminated`: the engine stopped on the last of these ids (EOS or
        a stop token id); its text is left out unless include_stop_str_in_output.
        `final`: the engine will send nothing more, so pending partial
        characters are flushed. Returns the stop string found, or None.
        Several ids at once (a speculative step's accepted run) are checked
        one by one, so ids after the one that completes a stop string are
        dropped, as a step-by-step run never produces them.
        """
        if self._finished:
            return None
        skip_last = bool(new_token_ids) and stop_terminated and not self.include_stop_str_in_output
        to_decode = new_token_ids[:-1] if skip_last else new_token_ids
        check_from = len(self.output_text)
        each = self.stop and len(to_decode) > 1
        for token_id in to_decode:
            self.output_token_ids.append(token_id)
            self.output_text += self._decoder.decode_next(token_id)
            if len(self.output_token_ids) <= self.min_tokens:
                # vLLM: text of the first min_tokens tokens cannot stop a request.
                check_from = len(self.output_text)
            elif each:
                stop_str = self._stop_string(check_from)
                if stop_str is not None:
                    return stop_str
                check_from = len(self.output_text)
        if skip_last:
            self.output_token_ids.append(new_token_ids[-1])
        if final:
            self.output_text += self._decoder.flush()
            self._finished = True
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._stop_string(check_from)

    def resume(self, token_ids: Sequence[int], sent_chars: int) -> None:
        """Take `token_ids` as produced already (by an engine this stream
        left), and the first `sent_chars` characters of their text as sent.
        That engine found no stop string in them, or it would have finished."""
        assert not self.output_token_ids, "a sequence resumes before it produces"
        self.update(token_ids, stop_terminated=False)
        self._sent_offset = min(sent_chars, len(self.output_text))

    def _stop_string(self, check_from: int) -> str | None:
        """The stop string ending in the text after `check_from`, if any:
        then the text is cut at it and the sequence is finished."""
        match = check_stop_strings(
            self.output_text, len(self.output_text) - check_from, self.stop, self.include_stop_str_in_output
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        # partial_stop_length guarantees truncate_to >= _sent_offset; clamp
        # anyway so a broken invariant leaks text instead of failing the engine.
        truncate_to = max(truncate_to, self._sent_offset)
        self.output_text = self.output_text[:truncate_to]
        self._finished = True
        return stop_str

    def finish(self) -> None:
        """Mark the sequence done (abort): flush pending characters, no stop check."""
        if not self._finished:
            self.output_text += self._decoder.flush()
            self._finished = True

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: all of it (`delta=False`) or only what is new.

        Before the end, a tail that could still grow into a stop string is
        withheld; `finished` releases everything.
        """
        end = len(self.output_text)
        if not finished and self._hold_back:
            end -= partial_stop_length(self.output_text, self.stop)
        if not delta:
            return self.output_text[:end]
        if end <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset : end]
        self._sent_offset = end
        return text
