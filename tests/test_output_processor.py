"""OutputProcessor and detokenizer: text, stop strings, streaming kinds,
logprobs, n > 1 aggregation, aborts, metrics.

Engine-core outputs are built by hand, token by token, from a real (tiny,
byte-level BPE) tokenizer, so the tests control exactly how text splits
across tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rayvllm.config import ModelConfig
from rayvllm.frontend.detokenizer import (
    FastIncrementalDetokenizer,
    RequestDetokenizer,
    SlowIncrementalDetokenizer,
    check_stop_strings,
    make_incremental_detokenizer,
    partial_stop_length,
)
from rayvllm.frontend.output_processor import OutputProcessor
from rayvllm.frontend.processor import Processor, fan_out
from rayvllm.messages.engine_types import EngineCoreOutput, LogprobsLists
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.outputs import Logprob, RequestOutput, RequestOutputKind
from rayvllm.messages.request import EngineCoreRequest, FinishReason
from rayvllm.messages.sampling_params import SamplingParams

EOS = 2
IM_START, IM_END = 3, 4
FFFD = "\ufffd"
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tok(tiny_tokenizer: Any) -> Any:
    return tiny_tokenizer


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path, tok: Any) -> Processor:
    config = ModelConfig.from_path(str(tiny_model_dir), None, "auto", 512, 0, "cpu")
    return Processor(config, tok)


def enc(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@dataclass
class Run:
    """What a client saw while the engine fed one request."""

    outputs: list[RequestOutput] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    fed: int = 0  # token ids the engine produced before it was told to stop

    @property
    def final(self) -> RequestOutput:
        assert self.outputs and self.outputs[-1].finished
        return self.outputs[-1]

    @property
    def texts(self) -> list[str]:
        return [o.outputs[0].text for o in self.outputs]


def drive(
    op: OutputProcessor,
    request_id: str,
    ids: list[int],
    chunks: list[int] | None = None,
    finish: FinishReason = FinishReason.LENGTH,
    stop_reason: int | str | None = None,
    rows: LogprobsLists | None = None,
) -> Run:
    """Feed `ids` as an engine core would: in `chunks` (default one token per
    step), the last step carrying `finish`; stop once the processor asks for
    an abort (a stop string) or finishes the request."""
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    assert sum(sizes) == len(ids)
    run = Run()
    pos = 0
    for step, size in enumerate(sizes):
        last = step == len(sizes) - 1
        out = EngineCoreOutput(
            request_id=request_id,
            new_token_ids=ids[pos : pos + size],
            new_logprobs=rows.slice(pos, pos + size) if rows is not None else None,
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
        )
        pos += size
        run.fed = pos
        result = op.process_outputs([out], now=100.0 + step)
        run.outputs.extend(result.request_outputs)
        run.aborted.extend(result.reqs_to_abort)
        if result.reqs_to_abort or any(o.finished for o in result.request_outputs):
            break
    return run


def add(
    op: OutputProcessor,
    processor: Processor,
    request_id: str,
    params: SamplingParams,
    kind: RequestOutputKind = CUMULATIVE,
    prompt: str = "hello world",
) -> EngineCoreRequest:
    req = processor.process(request_id, prompt, params, arrival_time=50.0)
    op.add_request(req, prompt, output_kind=kind)
    return req


def random_text(rng: random.Random, n_words: int) -> str:
    words = ["the", "house", "é", "😀", "über", "中文", "STOP", "ray", "serve", "fast", "naïve", "a"]
    return "".join(rng.choice([" ", "", ", "]) + rng.choice(words) for _ in range(n_words))


# ---- incremental detokenizers ------------------------------------------------------------


@pytest.mark.parametrize("force_slow", [False, True])
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_decode_matches_full_decode(tok: Any, force_slow: bool, skip_special: bool) -> None:
    rng = random.Random(1234)
    vocab = len(tok)
    for trial in range(60):
        # Random ids cover byte tokens that never complete a character,
        # specials and filler entries; the stream must still add up.
        ids = [rng.randrange(vocab) if rng.random() < 0.7 else rng.randrange(300) for _ in range(rng.randint(1, 25))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        detok = make_incremental_detokenizer(
            tok, prompt, skip_special_tokens=skip_special, spaces_between_special_tokens=False, force_slow=force_slow
        )
        expected_type = SlowIncrementalDetokenizer if force_slow else FastIncrementalDetokenizer
        assert isinstance(detok, expected_type)
        text = "".join(detok.decode_next(i) for i in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip_special), (trial, ids)


@pytest.mark.parametrize("force_slow", [False, True])
def test_multibyte_characters_never_stream_partially(tok: Any, force_slow: bool) -> None:
    text = " é 😀 über 中文 naïve"
    ids = enc(tok, text)
    assert len(ids) > len(text.split())  # byte-level: characters span several tokens
    detok = make_incremental_detokenizer(tok, enc(tok, "hello"), force_slow=force_slow)
    pieces = [detok.decode_next(i) for i in ids]
    assert all(FFFD not in p for p in pieces)
    assert "".join(pieces) == text
    assert detok.flush() == ""
    # The 4 byte tokens of the emoji: nothing until the last one.
    emoji = enc(tok, "😀")
    detok = make_incremental_detokenizer(tok, [], force_slow=force_slow)
    assert [detok.decode_next(i) for i in emoji] == ["", "", "", "😀"]


@pytest.mark.parametrize("force_slow", [False, True])
def test_prompt_ending_mid_character(tok: Any, force_slow: bool) -> None:
    e_bytes = enc(tok, "é")
    prompt = enc(tok, "the house") + e_bytes[:1]  # prompt cut inside "é"
    ids = enc(tok, " ray fast")
    detok = make_incremental_detokenizer(tok, prompt, force_slow=force_slow)
    assert "".join(detok.decode_next(i) for i in ids) + detok.flush() == " ray fast"


def test_flush_releases_an_unfinished_character(tok: Any) -> None:
    # A sequence cut by max_tokens inside a character: the stream never shows
    # U+FFFD mid-way; the final text matches tokenizer.decode, which does.
    ids = enc(tok, " a😀")[:-2]
    detok = make_incremental_detokenizer(tok, [])
    assert "".join(detok.decode_next(i) for i in ids) == " a"
    assert detok.flush() == tok.decode(ids)[len(" a") :]
    assert FFFD in tok.decode(ids)


def test_special_tokens_and_spacing(tok: Any) -> None:
    ids = [IM_START] + enc(tok, "user") + [IM_END, IM_START, IM_END]
    for skip, fast_expected in [(True, "user"), (False, "<|im_start|>user<|im_end|><|im_start|><|im_end|>")]:
        for spaces in (True, False):
            detok = make_incremental_detokenizer(tok, [], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            assert "".join(detok.decode_next(i) for i in ids) + detok.flush() == fast_expected
    # The pure-Python path follows HF slow tokenizers: added tokens are
    # joined to neighbouring text with spaces unless told otherwise.
    slow = make_incremental_detokenizer(tok, [], skip_special_tokens=False, force_slow=True)
    assert "".join(slow.decode_next(i) for i in ids) == "<|im_start|> user <|im_end|> <|im_start|> <|im_end|>"
    slow = make_incremental_detokenizer(
        tok, [], skip_special_tokens=False, spaces_between_special_tokens=False, force_slow=True
    )
    assert "".join(slow.decode_next(i) for i in ids) == "<|im_start|>user<|im_end|><|im_start|><|im_end|>"


def test_long_generation_slow_path_trims_state(tok: Any) -> None:
    ids = enc(tok, " the house is small" * 60)
    detok = make_incremental_detokenizer(tok, [], force_slow=True)
    assert isinstance(detok, SlowIncrementalDetokenizer)
    assert "".join(detok.decode_next(i) for i in ids) == " the house is small" * 60
    assert len(detok._tokens) < 80  # old token strings are dropped


# ---- stop string primitives ------------------------------------------------------------------


def test_check_stop_strings_window_and_choice() -> None:
    # Only matches that end in the new text count.
    assert check_stop_strings("xxSTOPyy", 2, ["STOP"], False) is None
    assert check_stop_strings("xxSTOPyy", 4, ["STOP"], False) == ("STOP", 2)
    assert check_stop_strings("xxSTOPyy", 4, ["STOP"], True) == ("STOP", 6)
    # Earliest end wins, whatever the list order; same end: the longer.
    assert check_stop_strings("abcdef", 6, ["cdef", "bc"], False) == ("bc", 1)
    assert check_stop_strings("abcdef", 6, ["cd", "bcd"], False) == ("bcd", 1)
    assert check_stop_strings("abc", 0, ["a"], False) is None


def test_partial_stop_length() -> None:
    assert partial_stop_length("hello ST", ["STOP"]) == 2
    assert partial_stop_length("hello STOP", ["STOP"]) == 0  # complete: the checker's job
    assert partial_stop_length("ab", ["abc", "bx"]) == 2
    assert partial_stop_length("xyz", ["abc"]) == 0
    assert partial_stop_length("", ["abc"]) == 0


# ---- stop strings through the OutputProcessor ------------------------------------------------


def test_stop_string_split_across_tokens(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    ids = enc(tok, " the house is small")  # Ġthe Ġhouse Ġis Ġsmall
    assert len(ids) == 4
    add(op, processor, "r", SamplingParams(stop=["e hou"], max_tokens=20))
    run = drive(op, "r", ids)
    assert run.aborted == ["r"]  # the core does not know stop strings
    assert run.fed == 2  # found as soon as "Ġhouse" completed it
    out = run.final.outputs[0]
    assert out.text == " th"
    assert (out.finish_reason, out.stop_reason) == ("stop", "e hou")
    assert out.token_ids == ids[:2]
    assert not op.has_unfinished_requests()


def test_stop_string_inside_one_token(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(stop=["ous"], max_tokens=20))
    run = drive(op, "r", enc(tok, " the house is small"))
    assert run.final.outputs[0].text == " the h"
    assert run.fed == 2


def test_include_stop_str_in_output(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(stop=["e hou"], include_stop_str_in_output=True, max_tokens=20), DELTA)
    run = drive(op, "r", enc(tok, " the house is small"))
    out = run.final.outputs[0]
    assert "".join(run.texts) == " the hou"
    assert (out.finish_reason, out.stop_reason) == ("stop", "e hou")


def test_stop_string_of_single_character_tokens(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    ids = enc(tok, " ray STOP fast")
    add(op, processor, "r", SamplingParams(stop=["STOP"], max_tokens=20), DELTA)
    run = drive(op, "r", ids)
    assert "".join(run.texts) == " ray "
    # While S, ST, STO arrived nothing of them was shown.
    assert all("S" not in t for t in run.texts)
    assert run.final.outputs[0].stop_reason == "STOP"


def test_stop_string_needs_min_tokens(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    ids = enc(tok, " the house is the house")  # 5 tokens
    add(op, processor, "r", SamplingParams(stop=["house"], min_tokens=2, max_tokens=20))
    run = drive(op, "r", ids)
    # The first "house" is the 2nd token, inside min_tokens: ignored.
    assert run.final.outputs[0].text == " the house is the "
    assert run.fed == 5


def test_stop_string_and_length_in_same_step(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    ids = enc(tok, " the house is small")
    add(op, processor, "r", SamplingParams(stop=["is"], max_tokens=4))
    run = drive(op, "r", ids, chunks=[4], finish=FinishReason.LENGTH)
    assert run.aborted == []  # the core already finished it
    out = run.final.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" the house ", "stop", "is")


def test_stop_token_ids(tok: Any, processor: Processor) -> None:
    ids = enc(tok, " the house is small")
    stop_id = ids[2]  # "Ġis"
    for include, expected in [(False, " the house"), (True, " the house is")]:
        op = OutputProcessor(tok)
        add(op, processor, "r", SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include))
        run = drive(op, "r", ids[:3], finish=FinishReason.STOP, stop_reason=stop_id)
        out = run.final.outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", stop_id)
        assert out.token_ids == ids[:3]  # the stop token is still an output token
        assert run.aborted == []


def test_eos_finish(tok: Any, processor: Processor) -> None:
    ids = enc(tok, " hello world") + [EOS]
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(skip_special_tokens=False))
    out = drive(op, "r", ids, finish=FinishReason.STOP, stop_reason=None).final.outputs[0]
    # The EOS token's text is left out even when specials are shown (vLLM).
    assert (out.text, out.finish_reason, out.stop_reason) == (" hello world", "stop", None)
    assert out.token_ids == ids


def test_max_tokens_length_finish(tok: Any, processor: Processor) -> None:
    ids = enc(tok, " ray serve fast")
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(max_tokens=3), FINAL_ONLY)
    run = drive(op, "r", ids, finish=FinishReason.LENGTH)
    assert len(run.outputs) == 1  # FINAL_ONLY: one output, at the end
    out = run.final.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" ray serve fast", "length", None)
    assert out.finished() and run.final.finished


def test_outputs_of_several_steps_in_one_call_join_their_deltas(tok: Any, processor: Processor) -> None:
    """The Ray client hands over every push that has arrived at once, so a
    request may appear once per step in one call: one RequestOutput per
    request, its DELTA covering all of them, nothing lost."""
    ids = enc(tok, " ray serve fast")
    op = OutputProcessor(tok)
    add(op, processor, "a", SamplingParams(max_tokens=len(ids)), DELTA)
    add(op, processor, "b", SamplingParams(max_tokens=len(ids)), DELTA)
    steps = [
        EngineCoreOutput(request_id=rid, new_token_ids=[t]) for t in ids[:-1] for rid in ("a", "b")
    ]
    first = op.process_outputs(steps, now=100.0).request_outputs
    assert [o.request_id for o in first] == ["a", "b"]
    assert all(o.outputs[0].token_ids == ids[:-1] for o in first)
    last = op.process_outputs(
        [EngineCoreOutput(request_id="a", new_token_ids=ids[-1:], finish_reason=FinishReason.LENGTH)], now=101.0
    ).request_outputs
    assert "".join(o.outputs[0].text for o in first[:1] + last) == " ray serve fast"


def test_multibyte_stream_through_processor(tok: Any, processor: Processor) -> None:
    text = " é and 😀 über 中文"
    ids = enc(tok, text)
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(max_tokens=len(ids)), DELTA)
    run = drive(op, "r", ids)
    assert all(FFFD not in t for t in run.texts)
    assert "".join(run.texts) == text
    assert sum(len(o.outputs[0].token_ids) for o in run.outputs) == len(ids)


def _check_stop_ids(tok: Any, got: list[int], ids: list[int], fed: int, full: str, hits: list) -> None:
    """The ids shown: all fed, except (as vLLM) those fed in the same chunk
    after the one that completes a stop string."""
    if not hits:
        assert got == ids[:fed]
        return
    end = min(hits)[0]
    n = len(got)
    assert got == ids[:n] and n <= fed
    assert tok.decode(ids[:n]).startswith(full[:end])
    assert not tok.decode(ids[: n - 1]).startswith(full[:end])


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_streaming_fuzz_against_reference(tok: Any, processor: Processor, kind: RequestOutputKind) -> None:
    """Random text, random stop strings, random chunking: every kind agrees
    with a reference cut of the full decode; a DELTA stream concatenates to
    the final text and a CUMULATIVE stream only ever extends it."""
    rng = random.Random(99 + int(kind))
    for trial in range(40):
        text = random_text(rng, rng.randint(3, 12))
        ids = enc(tok, text)
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randint(1, 6)])
        stops.append(rng.choice(["STOP", "zzz", "é 😀"]))
        include = rng.random() < 0.3
        # Reference: the occurrence that ends first, then the longest.
        hits = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
        if hits:
            end, neg_len, stop = min(hits)
            expected = full[:end] if include else full[: end + neg_len]
            expected_reason: tuple[str, Any] = ("stop", stop)
        else:
            expected, expected_reason = full, ("length", None)
        chunks = []
        left = len(ids)
        while left:
            size = min(left, rng.randint(1, 4))
            chunks.append(size)
            left -= size
        op = OutputProcessor(tok)
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=len(ids))
        add(op, processor, "r", params, kind)
        run = drive(op, "r", ids, chunks=chunks)
        final = run.final.outputs[0]
        assert (final.finish_reason, final.stop_reason) == expected_reason, (trial, text, stops)
        assert [o.finished for o in run.outputs] == [False] * (len(run.outputs) - 1) + [True]
        if kind is DELTA:
            assert "".join(run.texts) == expected, (trial, text, stops, run.texts)
            assert all(FFFD not in t for t in run.texts)
            _check_stop_ids(tok, sum((o.outputs[0].token_ids for o in run.outputs), []), ids, run.fed, full, hits)
        elif kind is CUMULATIVE:
            assert final.text == expected
            assert all(expected.startswith(t) for t in run.texts), (trial, text, stops, run.texts)
            _check_stop_ids(tok, final.token_ids, ids, run.fed, full, hits)
        else:
            assert len(run.outputs) == 1 and final.text == expected


# ---- logprobs --------------------------------------------------------------------------------


def make_rows(chosen: list[int], top: list[list[int]], base: float = -1.0) -> LogprobsLists:
    """Rows shaped like the sampler's: column 0 the chosen id, then top-N."""
    ids, lps, ranks = [], [], []
    for c, t in zip(chosen, top):
        ids.append([c] + t)
        lps.append([base - 0.5] + [base + 0.1 * -j for j in range(len(t))])
        ranks.append(t.index(c) + 1 if c in t else len(t) + 7)
    return LogprobsLists(ids, lps, ranks)


def test_logprobs_trimmed_and_decoded(tok: Any, processor: Processor) -> None:
    ids = enc(tok, " the house is")
    other = enc(tok, " ray serve fast small")
    # Position 0: chosen is the best; position 1: outside the top 5; position 2: 2nd.
    tops = [[ids[0]] + other, other + [ids[0]], [other[0], ids[2]] + other[1:]]
    rows = make_rows(ids, tops)
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(logprobs=2, max_tokens=3))
    out = drive(op, "r", ids, rows=rows).final.outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    first, second, third = out.logprobs
    assert list(first) == [ids[0], other[0]]  # chosen in the top 2: 2 entries
    assert list(second) == [ids[1], other[0], other[1]]  # chosen outside: 2 + 1
    assert list(third) == [ids[2], other[0]]
    assert first[ids[0]] == Logprob(-1.5, 1, " the")
    assert second[ids[1]].rank == len(tops[1]) + 7
    assert second[other[0]] == Logprob(-1.0, 1, tok.decode([other[0]]))
    assert second[other[1]].rank == 2
    assert third[ids[2]].rank == 2 and third[ids[2]].decoded_token == " is"
    assert out.cumulative_logprob == pytest.approx(-4.5)


def test_logprobs_zero_and_none(tok: Any, processor: Processor) -> None:
    ids = enc(tok, " the house")
    rows = make_rows(ids, [[5, 6], [7, 8]])
    op = OutputProcessor(tok)
    add(op, processor, "a", SamplingParams(logprobs=0, max_tokens=2))
    out = drive(op, "a", ids, rows=rows).final.outputs[0]
    assert out.logprobs is not None and [list(d) for d in out.logprobs] == [[ids[0]], [ids[1]]]
    add(op, processor, "b", SamplingParams(max_tokens=2))
    out = drive(op, "b", ids, rows=rows).final.outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_logprobs_of_byte_tokens_decode_alone(tok: Any, processor: Processor) -> None:
    ids = enc(tok, "é")
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(logprobs=1, max_tokens=2))
    out = drive(op, "r", ids, rows=make_rows(ids, [[ids[0]], [ids[1]]])).final.outputs[0]
    assert out.text == "é"
    assert [d[i].decoded_token for d, i in zip(out.logprobs or [], ids)] == [FFFD, FFFD]


def test_delta_logprobs_per_step(tok: Any, processor: Processor) -> None:
    ids = enc(tok, " the house is small")
    rows = make_rows(ids, [[i] for i in ids])
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(logprobs=1, max_tokens=4), DELTA)
    run = drive(op, "r", ids, rows=rows)
    assert [len(o.outputs[0].logprobs or []) for o in run.outputs] == [1, 1, 1, 1]
    assert [o.outputs[0].cumulative_logprob for o in run.outputs] == pytest.approx([-1.5, -3.0, -4.5, -6.0])


def test_prompt_logprobs(tok: Any, processor: Processor) -> None:
    prompt = " the house is small"
    op = OutputProcessor(tok)
    req = processor.process("r", prompt, SamplingParams(prompt_logprobs=1, max_tokens=2), arrival_time=1.0)
    op.add_request(req, prompt, output_kind=DELTA)
    p = req.prompt_token_ids
    assert len(p) == 4
    # Chunked prefill: positions 1-2, then 3 with the first sampled token.
    first = op.process_outputs(
        [EngineCoreOutput("r", [], new_prompt_logprobs=make_rows(p[1:3], [[9, 10], [p[2], 9]]))]
    ).request_outputs
    assert len(first) == 1 and first[0].prompt_logprobs is not None
    assert first[0].prompt_logprobs[0] is None
    assert [list(d) for d in first[0].prompt_logprobs[1:] if d is not None] == [[p[1], 9], [p[2]]]
    assert [o.text for o in first[0].outputs] == [""]
    gen = enc(tok, " ray")
    second = op.process_outputs(
        [EngineCoreOutput("r", gen, new_prompt_logprobs=make_rows(p[3:], [[p[3]]]))]
    ).request_outputs[0]
    assert second.prompt_logprobs is not None and len(second.prompt_logprobs) == 1  # only the new position
    third = op.process_outputs([EngineCoreOutput("r", gen, finish_reason=FinishReason.LENGTH)]).request_outputs[0]
    assert third.prompt_logprobs is None  # nothing new


def test_cumulative_prompt_logprobs_complete(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    req = processor.process("r", " the house", SamplingParams(prompt_logprobs=0, max_tokens=1))
    op.add_request(req, " the house", output_kind=FINAL_ONLY)
    p = req.prompt_token_ids
    out = op.process_outputs(
        [EngineCoreOutput("r", [5], new_prompt_logprobs=make_rows(p[1:], [[p[1], 7]]), finish_reason=FinishReason.LENGTH)]
    ).request_outputs[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(p)
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1] is not None
    assert out.prompt_logprobs[1][p[1]].decoded_token == tok.decode([p[1]])


# ---- n > 1 -----------------------------------------------------------------------------------


def add_parent(
    op: OutputProcessor, processor: Processor, request_id: str, params: SamplingParams, kind: RequestOutputKind
) -> list[EngineCoreRequest]:
    requests, prompt = processor.process_with_fanout(request_id, "hello world", params)
    for index, child in enumerate(requests):
        op.add_request(child, prompt, parent_id=request_id, index=index, n=len(requests), output_kind=kind)
    return requests


def step(op: OutputProcessor, *outs: EngineCoreOutput) -> list[RequestOutput]:
    return op.process_outputs(list(outs)).request_outputs


def test_n_final_only_aggregates_sorted(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    children = add_parent(op, processor, "p", SamplingParams(n=3, max_tokens=2, seed=0), FINAL_ONLY)
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert op.get_num_unfinished_requests() == 3 and op.get_num_unfinished_user_requests() == 1
    a, b, c = enc(tok, " the"), enc(tok, " ray"), enc(tok, " fast")
    assert step(op, EngineCoreOutput("2_p", c), EngineCoreOutput("0_p", a), EngineCoreOutput("1_p", b)) == []
    # Children finish out of order; nothing until the last one.
    assert step(op, EngineCoreOutput("2_p", a, finish_reason=FinishReason.LENGTH)) == []
    assert step(op, EngineCoreOutput("0_p", [EOS], finish_reason=FinishReason.STOP)) == []
    (out,) = step(op, EngineCoreOutput("1_p", b, finish_reason=FinishReason.LENGTH))
    assert out.request_id == "p" and out.finished and out.prompt == "hello world"
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.text for o in out.outputs] == [" the", " ray ray", " fast the"]
    assert [o.finish_reason for o in out.outputs] == ["stop", "length", "length"]
    assert out.metrics is not None and out.metrics.num_generation_tokens == 6
    assert not op.has_unfinished_requests() and op.get_num_unfinished_user_requests() == 0


def test_n_cumulative_and_delta(tok: Any, processor: Processor) -> None:
    a, b = enc(tok, " the"), enc(tok, " ray")
    op = OutputProcessor(tok)
    add_parent(op, processor, "c", SamplingParams(n=2, max_tokens=2), CUMULATIVE)
    (out,) = step(op, EngineCoreOutput("1_c", b))
    # Cumulative: every sequence, even one that has produced nothing yet.
    assert [(o.index, o.text) for o in out.outputs] == [(0, ""), (1, " ray")] and not out.finished
    (out,) = step(op, EngineCoreOutput("0_c", a), EngineCoreOutput("1_c", b, finish_reason=FinishReason.LENGTH))
    assert [(o.text, o.finish_reason) for o in out.outputs] == [(" the", None), (" ray ray", "length")]
    assert not out.finished
    (out,) = step(op, EngineCoreOutput("0_c", a, finish_reason=FinishReason.LENGTH))
    assert out.finished and [o.text for o in out.outputs] == [" the the", " ray ray"]

    op = OutputProcessor(tok)
    add_parent(op, processor, "d", SamplingParams(n=2, max_tokens=2), DELTA)
    (out,) = step(op, EngineCoreOutput("1_d", b), EngineCoreOutput("0_d", a))
    assert [(o.index, o.text) for o in out.outputs] == [(0, " the"), (1, " ray")]  # sorted by index
    (out,) = step(op, EngineCoreOutput("1_d", b, finish_reason=FinishReason.LENGTH))
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [(1, " ray", "length")]
    assert not out.finished
    (out,) = step(op, EngineCoreOutput("0_d", a, finish_reason=FinishReason.LENGTH))
    assert out.finished and [(o.index, o.text) for o in out.outputs] == [(0, " the")]


def test_n_child_stop_string_aborts_only_that_child(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add_parent(op, processor, "p", SamplingParams(n=2, stop=["house"], max_tokens=5), FINAL_ONLY)
    result = op.process_outputs(
        [EngineCoreOutput("0_p", enc(tok, " the house")), EngineCoreOutput("1_p", enc(tok, " the"))]
    )
    assert result.reqs_to_abort == ["0_p"] and result.request_outputs == []
    (out,) = step(op, EngineCoreOutput("1_p", enc(tok, " ray"), finish_reason=FinishReason.LENGTH))
    assert [(o.text, o.stop_reason) for o in out.outputs] == [(" the ", "house"), (" the ray", None)]


# ---- aborts, bookkeeping, metrics ------------------------------------------------------------


def test_abort_returns_final_outputs(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(stop=["STOP"], max_tokens=20), DELTA)
    shown = [o.outputs[0].text for o in step(op, EngineCoreOutput("r", enc(tok, " ray ST")))]
    assert shown == [" ray "]  # "ST" may become "STOP": held back
    assert op.child_request_ids(["r", "unknown"]) == ["r"]
    (out,) = op.abort_requests(["r"])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].text == "ST"  # no stop string after all: released
    assert not op.has_unfinished_requests()
    # Late core outputs of an aborted request are dropped.
    assert step(op, EngineCoreOutput("r", [5])) == []
    assert op.abort_requests(["r"]) == []


def test_abort_parent_expands_children(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add_parent(op, processor, "p", SamplingParams(n=3, max_tokens=4), CUMULATIVE)
    step(op, EngineCoreOutput("1_p", enc(tok, " the"), finish_reason=FinishReason.LENGTH))
    assert op.child_request_ids(["p"]) == ["0_p", "2_p"]
    (out,) = op.abort_requests(["p", "0_p"])
    assert out.finished
    assert [o.finish_reason for o in out.outputs] == ["abort", "length", "abort"]
    assert not op.has_unfinished_requests()


def test_abort_one_child(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add_parent(op, processor, "p", SamplingParams(n=2, max_tokens=4), FINAL_ONLY)
    assert op.abort_requests(["1_p"]) == []  # the parent is still running
    (out,) = step(op, EngineCoreOutput("0_p", enc(tok, " ray"), finish_reason=FinishReason.LENGTH))
    assert [o.finish_reason for o in out.outputs] == ["length", "abort"]


def test_metrics_and_cached_tokens(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(max_tokens=3))
    assert op.process_outputs([EngineCoreOutput("r", [], num_cached_tokens=16)], now=60.0).request_outputs
    op.process_outputs([EngineCoreOutput("r", enc(tok, " ray"), num_cached_tokens=16)], now=61.0)
    # An output that does not carry the count (0) never lowers it.
    op.process_outputs([EngineCoreOutput("r", enc(tok, " ray"), num_cached_tokens=0)], now=62.0)
    (out,) = op.process_outputs(
        [EngineCoreOutput("r", enc(tok, " ray"), finish_reason=FinishReason.LENGTH, num_cached_tokens=16)], now=63.0
    ).request_outputs
    m = out.metrics
    assert m is not None
    assert (m.arrival_time, m.first_token_time, m.last_token_time, m.finished_time) == (50.0, 61.0, 63.0, 63.0)
    assert m.num_generation_tokens == 3 and m.time_to_first_token == 11.0 and m.e2e_latency == 13.0
    assert out.num_cached_tokens == 16


def test_unknown_and_duplicate_requests(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    assert op.process_outputs([EngineCoreOutput("ghost", [5])]).request_outputs == []
    req = add(op, processor, "r", SamplingParams())
    with pytest.raises(InvalidParameterError) as e:
        op.add_request(req, "x")
    assert e.value.param == "request_id"
    parent = processor.process("p", "hi", SamplingParams(n=2))
    with pytest.raises(InvalidParameterError):
        op.add_request(fan_out(parent)[0], "hi", n=2, index=0)  # n > 1 needs parent_id
    assert op.get_num_unfinished_requests() == 1


def test_cumulative_outputs_are_snapshots(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    add(op, processor, "r", SamplingParams(max_tokens=2))
    (first,) = step(op, EngineCoreOutput("r", enc(tok, " the")))
    (second,) = step(op, EngineCoreOutput("r", enc(tok, " ray"), finish_reason=FinishReason.LENGTH))
    assert first.outputs[0].token_ids == enc(tok, " the")  # not mutated by the later step
    assert second.outputs[0].text == " the ray"


def test_end_to_end_with_processor(tok: Any, processor: Processor) -> None:
    op = OutputProcessor(tok)
    messages = [{"role": "user", "content": "hi"}]
    req = processor.process_chat("chat", messages, SamplingParams(max_tokens=8, stop=["<|"]))
    op.add_request(req, processor.render_chat(messages), output_kind=DELTA)
    gen = enc(tok, " hello world") + [IM_END]
    # skip_special_tokens hides <|im_end|>'s text, so "<|" never appears.
    run = drive(op, "chat", gen, finish=FinishReason.STOP, stop_reason=IM_END)
    assert "".join(run.texts) == " hello world"
    assert run.final.prompt_token_ids == req.prompt_token_ids


def test_request_detokenizer_direct(tok: Any) -> None:
    params = SamplingParams(stop=["world"])
    detok = RequestDetokenizer(tok, [], params)
    assert detok.update(enc(tok, " hello"), stop_terminated=False) is None
    assert detok.get_next_output_text(finished=False, delta=True) == " hello"
    assert detok.update(enc(tok, " world"), stop_terminated=False) == "world"
    assert detok.output_text == " hello "
    assert detok.get_next_output_text(finished=True, delta=True) == " "
    assert detok.update(enc(tok, " more"), stop_terminated=False) is None  # done: ignored


def test_resumed_request_carries_its_tokens_and_repeats_no_prompt_logprob(tok: Any, processor: Processor) -> None:
    """After an engine restart the new core recomputes the prompt and sends
    its prompt logprob rows again: the rows already held are skipped, the
    missing ones kept, and the resumed request carries every token so far."""
    prompt = " the house is small"
    op = OutputProcessor(tok)
    req = processor.process("r", prompt, SamplingParams(prompt_logprobs=0, max_tokens=6), arrival_time=1.0)
    op.add_request(req, prompt, output_kind=DELTA)
    p = req.prompt_token_ids
    rows = make_rows(p[1:], [[t] for t in p[1:]])
    # The old core: positions 1-2 of the prompt (a chunk), then it dies.
    op.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=rows.slice(0, 2))])
    ((resumed,),) = op.resumable_requests()
    assert resumed.output_token_ids == [] and resumed.prompt_token_ids == p
    # The new core: all prompt positions again, with two tokens.
    gen = enc(tok, " ray is")[:2]
    out = op.process_outputs([EngineCoreOutput("r", gen, new_prompt_logprobs=rows)]).request_outputs[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 1  # only position 3 is new
    ((again,),) = op.resumable_requests()
    assert again.output_token_ids == gen and again.sampling_params is req.sampling_params
    # Failing a request drops it (every child of an n > 1 request) with no output.
    assert op.drop_requests(["r", "unknown"]) == ["r"] and not op.has_unfinished_requests()
