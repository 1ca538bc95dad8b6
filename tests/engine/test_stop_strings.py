"""`SamplingParams.stop` (stop strings), with vLLM's semantics: the text is cut before the first stop string the
output contains (`include_stop_str_in_output` keeps it), the token ids end at the token that completed it,
`stop_reason` is the string; checked per token, so speculative decoding and async scheduling stop at the same
token as plain decoding."""

from __future__ import annotations

import pytest

from research_lm import LLM, SamplingParams
from research_lm.engine.stop_strings import StopStrings

PROMPT = "def add(a, b):\n    return"
FREE = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", device="cpu", max_model_len=128)


@pytest.fixture(scope="module")
def free(llm):
    """The unstopped greedy output and each token's text."""
    out = llm.generate([PROMPT], FREE, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    return out, [tok.decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]


def _stopped(llm, stop, **kw):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop, **kw)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def _expected(free, stop: str, include: bool = False):
    """(token ids up to the one whose text first contains stop, the text cut at stop)."""
    out, texts = free
    n = next(i for i, t in enumerate(texts) if stop in t) + 1
    at = texts[n - 1].index(stop)
    return out.token_ids[:n], texts[n - 1][: at + (len(stop) if include else 0)]


def _stop_strings(free) -> list[str]:
    """Stop strings that occur in the free output: one inside a token, one spanning tokens, one later."""
    out, texts = free
    text = texts[-1]
    picks = [text[3:5], text[8:14], text[len(text) // 2 : len(text) // 2 + 4]]
    assert all(p.strip() for p in picks), picks  # the tiny model's greedy text has content there
    return picks


def test_stop_string_cuts_the_text_and_ends_at_the_completing_token(llm, free):
    for stop in _stop_strings(free):
        want_ids, want_text = _expected(free, stop)
        out = _stopped(llm, [stop, "never appears \u2603"])
        assert (out.token_ids, out.text) == (want_ids, want_text), stop
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert len(out.token_ids) < len(free[0].token_ids)
        kept = _stopped(llm, stop, include_stop_str_in_output=True)
        assert kept.token_ids == want_ids and kept.text == _expected(free, stop, include=True)[1]
        assert kept.text.endswith(stop)


def test_the_earliest_stop_string_wins_and_absent_ones_change_nothing(llm, free):
    early, _, late = _stop_strings(free)
    out = _stopped(llm, [late, early])
    assert out.stop_reason == early and out.token_ids == _expected(free, early)[0]
    none = _stopped(llm, ["\u2603\u2603"])
    assert none.token_ids == free[0].token_ids and none.finish_reason == "length" and none.stop_reason is None


def test_min_tokens_ignores_stop_strings_in_the_first_tokens(llm, free):
    out_free, texts = free
    stop = _stop_strings(free)[0]
    first = _expected(free, stop)[0]
    out = _stopped(llm, stop, min_tokens=len(first))  # its first occurrence is inside the first min_tokens
    later = [i for i in range(len(first), len(texts)) if stop in texts[i][len(texts[len(first) - 1]) - len(stop) + 1:]]
    if later:
        assert out.stop_reason == stop and len(out.token_ids) == later[0] + 1
    else:
        assert out.finish_reason == "length" and out.token_ids == out_free.token_ids


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3},
])
def test_speculative_decoding_stops_at_the_same_token(free, spec):
    """Verify steps emit several tokens at once; the stop string still ends the output where plain decoding does."""
    spec_llm = LLM("tiny-llama", device="cpu", max_model_len=128, speculative_config=spec)
    accepted = 0
    for stop in _stop_strings(free):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop)
        res = spec_llm.generate([PROMPT], params, use_tqdm=False)[0]
        assert (res.outputs[0].token_ids, res.outputs[0].text) == _expected(free, stop), (spec["method"], stop)
        accepted += res.metrics.num_accepted_tokens
    assert accepted > 0  # steps did emit several tokens


def test_async_scheduling_stops_at_the_same_token(free):
    async_llm = LLM("tiny-llama", device="cpu", max_model_len=128, async_scheduling=True)
    for stop in _stop_strings(free):
        out = _stopped(async_llm, stop)
        assert (out.token_ids, out.text) == _expected(free, stop) and out.stop_reason == stop


def test_bad_stop_strings_name_the_field():
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=[3])
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams().stop == []


def test_a_model_without_tokenizer_rejects_stop_strings_alone(monkeypatch):
    llm = LLM("tiny-llama", device="cpu", max_model_len=64)
    monkeypatch.setattr(llm.engine, "tokenizer", None)
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], [SamplingParams(max_tokens=3, stop=["x"]),
                                                 SamplingParams(max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "stop_token_ids" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 3


def test_window_check_matches_a_full_decode(llm):
    """The windowed check finds exactly what searching the whole decoded text token by token finds."""
    from research_lm.engine.request import Request

    tok = llm.get_tokenizer()
    ids = tok.encode("print('héllo wörld') # done\n\tx = [1, 2, 3]\n" * 3)
    checker = StopStrings(tok)
    for stop in ["wörld", "\n\t", "3]\nprint", "é", " # d"]:
        req = Request("r", [1], SamplingParams(stop=[stop]), seed=0)
        hit = None
        for n in range(1, len(ids) + 1):
            req.output_token_ids = ids[:n]
            if checker.check(req, n) is not None:
                hit = n
                break
        full = next((n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n])), None)
        assert hit == full, stop
        if hit is not None:
            text = tok.decode(ids[:hit])
            assert req.output_text == text[: text.index(stop)]
