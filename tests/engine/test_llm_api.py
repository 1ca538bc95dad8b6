"""The `LLM` surface: strings or ids in, vLLM-shaped outputs back, failures isolated per request."""

from __future__ import annotations

import pytest
import torch

from research_lm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", device="cpu", max_model_len=128, seed=1)


def test_strings_in_text_out(llm):
    outs = llm.generate(["def add(a, b):", "import os\n"], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["def add(a, b):", "import os\n"]
    for o in outs:
        assert o.prompt_token_ids == llm.get_tokenizer().encode(o.prompt)
        assert 1 <= len(o.outputs[0].token_ids) <= 6
        assert o.outputs[0].text == llm.get_tokenizer().decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].finish_reason in {"stop", "length"}
        assert o.metrics.time_to_first_token is not None and o.metrics.time_to_first_token >= 0


def test_one_params_per_prompt_and_order_kept(llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 4, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 4, 7]
    assert outs[2].metrics.time_per_output_token is not None


def test_too_long_prompt_fails_alone(llm):
    prompts = [[1] * 200, [5, 6, 7], [9] * 10]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "max_model_len=128" in outs[0].error
    assert [len(o.outputs[0].token_ids) for o in outs[1:]] == [3, 3]
    assert all(o.error is None for o in outs[1:])


def test_logit_bias_and_allowed_token_ids(llm):
    """vLLM's fields: a large bias forces its token; allowed ids bound sampling; ids outside the vocabulary
    fail that request alone, naming the field."""
    forced = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       logit_bias={"9": 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [9, 9, 9, 9]
    outs = llm.generate([[5, 6, 7], [1, 2], [8]], [
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3, allowed_token_ids=[11, 12, 13]),
        SamplingParams(temperature=0, max_tokens=2, logit_bias={10**6: 1.0}),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert set(outs[0].outputs[0].token_ids) <= {11, 12, 13} and len(outs[0].outputs[0].token_ids) == 8
    assert outs[1].outputs[0].finish_reason == "error" and "logit_bias / allowed_token_ids" in outs[1].error
    plain = llm.generate([[8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert outs[2].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_max_model_len_stops_generation(llm):
    out = llm.generate([[3] * 120], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 128


def test_stop_token_ids(llm):
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[3]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_seeded_sampling_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)
    mixed = llm.generate([[40] * 9, [10, 11, 12], [7, 7]], [others, p, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_unseeded_runs_reproducible_from_engine_seed():
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    a = LLM("tiny-llama", device="cpu", max_model_len=64, seed=3).generate([[1, 2, 3]] * 2, p, use_tqdm=False)
    b = LLM("tiny-llama", device="cpu", max_model_len=64, seed=3).generate([[1, 2, 3]] * 2, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_logprobs(llm):
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.outputs[0].token_ids)
    for token, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        assert token in lp and lp[token].rank == 1  # greedy: the sampled token is the most likely
        assert len(lp) == 2


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM("tiny-llama", max_num_sequences=4)
    with pytest.raises(ValueError, match="neither an existing directory"):
        LLM("/nonexistent/checkpoint")
    with pytest.raises(ValueError, match="enforce_eager=True contradicts cuda_graphs=True"):
        LLM("tiny-llama", enforce_eager=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs one process per rank: launch with torchrun"):
        LLM("tiny-llama", tensor_parallel_size=2)


def test_enforce_eager_turns_graphs_and_compile_off():
    """vLLM's switch: the same engine with neither CUDA graphs nor torch.compile."""
    assert LLM("tiny-llama").config.cuda_graphs
    config = LLM("tiny-llama", enforce_eager=True, tensor_parallel_size=1).config
    assert not config.cuda_graphs and not config.compile


def test_load_format_dummy_needs_only_a_config(tmp_path):
    """vLLM's load_format="dummy": random weights from a config.json alone (speed runs of real shapes)."""
    from transformers import LlamaConfig

    from tests.conftest import TINY_SHAPE

    LlamaConfig(**TINY_SHAPE, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_gpu_blocks=16, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert all(p.abs().sum() > 0 for p in llm.engine.model.parameters())  # drawn, not left empty
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="npz", device="cpu")


def test_vllm_prompt_dicts_and_cumulative_logprob(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    by_ids, by_text, plain = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "def f"}, [5, 6, 7]], params,
                                          use_tqdm=False)
    assert by_ids.prompt_token_ids == [5, 6, 7] and by_ids.outputs[0].token_ids == plain.outputs[0].token_ids
    assert by_text.prompt == "def f"
    out = by_ids.outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
    assert out.cumulative_logprob < 0
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"text": "x"}], params, use_tqdm=False)


def test_parallel_sampling_n_completions_per_prompt(llm):
    """SamplingParams(n=k): one RequestOutput per prompt with k completions, in prompt order; a seeded request's
    completion i is the n = 1 request with seed + i."""
    seeded = SamplingParams(temperature=1.0, seed=40, max_tokens=6, ignore_eos=True, n=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=2)
    plain = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [12, 13]]
    outs = llm.generate(prompts, [seeded, greedy, plain], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs) for o in outs] == [3, 2, 1] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, c in enumerate(outs[0].outputs):
        alone = SamplingParams(temperature=1.0, seed=40 + i, max_tokens=6, ignore_eos=True)
        assert c.token_ids == llm.generate([prompts[0]], alone, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # different seeds, different samples
    assert outs[1].outputs[0].token_ids == outs[1].outputs[1].token_ids  # greedy: the same completion twice
    assert outs[0].metrics.num_output_tokens == 18
    unseeded = llm.generate([[5, 6]], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4),
                            use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1


def test_n_must_be_positive_and_the_engine_takes_one():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="SamplingParams.n"):
            SamplingParams(n=bad)
    engine = LLM("tiny-llama", device="cpu", max_model_len=32).engine
    req = engine.add_request([5, 6], SamplingParams(n=2))
    assert req.finish_reason == "error" and "LLM.generate" in req.error


def test_host_threads_sets_torch_threads_and_none_leaves_them():
    before = torch.get_num_threads()
    try:
        LLM("tiny-llama", device="cpu", host_threads=1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        LLM("tiny-llama", device="cpu")  # None: unchanged
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="host_threads must be >= 1"):
            LLM("tiny-llama", device="cpu", host_threads=0)
    finally:
        torch.set_num_threads(before)
