"""A bad request fails alone, at the edge (issue 27): every `SamplingParams` field and every `speculative_config` /
`eplb_config` value is type- and range-checked when it is built, with an error that names the field, instead of
failing deep inside a step (`int('abc')` in the RNG, a float in `topk`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from research_lm import LLM, SamplingParams
from research_lm.eplb.settings import EplbSettings
from research_lm.worker.spec import _METHOD_KEYS, check_speculative_config

CONF = Path(__file__).resolve().parents[2] / "conf"
NAN, INF = math.nan, math.inf

# field -> values refused: wrong types first, then out of range
BAD_SAMPLING = {
    "n": ["2", 2.0, True, None, 0, -1],
    "temperature": ["0.5", True, None, NAN, INF, -0.1],
    "top_p": ["1", None, NAN, 0.0, 1.5],
    "top_k": [2.5, "5", True, -2],
    "min_p": ["0", NAN, 1.5, -0.1],
    "presence_penalty": ["x", [1.0], 2.5],
    "frequency_penalty": [None, -INF, -3],
    "repetition_penalty": ["1", NAN, INF, 0.0],
    "seed": ["abc", 1.5, True],
    "max_tokens": ["16", 16.0, True, 0],
    "min_tokens": [1.0, None, -1],
    "logprobs": [2.5, "2", True, -1],
    "stop": [5, ["a", 3], b"x", [""]],
    "stop_token_ids": ["12", 5, [1.0], [True], [-1]],
    "include_stop_str_in_output": [1, "yes", None],
    "ignore_eos": [0, "False"],
    "skip_special_tokens": ["False", None],
    "logit_bias": [{"abc": 1.0}, {1.5: 1.0}, {True: 1.0}, {1: "x"}, {1: NAN}, [(1, 2.0)], {-1: 1.0}],
    "allowed_token_ids": ["123", 3, [1, "2"], [2.0], [], [-1]],
}


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in BAD_SAMPLING.items() for v in values])
def test_bad_sampling_params_field_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} must "):
        SamplingParams(**{field: value})


def test_every_sampling_params_field_is_checked():
    assert set(BAD_SAMPLING) == set(SamplingParams.__dataclass_fields__)


def test_good_values_are_normalized():
    """numpy scalars become Python ints and floats (the RNG and the sampler's tensors take those); JSON's string
    keys of logit_bias become ids, as vLLM takes them; a lone stop string becomes a list."""
    p = SamplingParams(n=np.int64(2), seed=np.int64(3), top_k=np.int32(-1), temperature=np.float32(0.5),
                       max_tokens=np.int16(4), logprobs=np.int64(2), stop="\n", stop_token_ids=(np.int64(7),),
                       logit_bias={"5": 1, np.int64(6): np.float32(-2.0)}, allowed_token_ids=np.arange(3),
                       repetition_penalty=1)
    assert (p.n, p.seed, p.top_k, p.temperature, p.max_tokens, p.logprobs) == (2, 3, 0, 0.5, 4, 2)
    assert all(type(v) is int for v in (p.n, p.seed, p.top_k, p.max_tokens, p.logprobs, *p.stop_token_ids,
                                        *p.logit_bias, *p.allowed_token_ids))
    assert type(p.temperature) is float and type(p.repetition_penalty) is float
    assert p.stop == ["\n"] and p.logit_bias == {5: 1.0, 6: -2.0} and p.allowed_token_ids == [0, 1, 2]
    assert [c.seed for c in p.children()] == [3, 4]  # children re-run the checks on the normalized values
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias={}).logit_bias is None


BAD_SPECULATIVE = [
    ({"method": "ngram", "num_speculative_tokens": "abc"}, "num_speculative_tokens", "a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens", "a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens", "a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens", "a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": "2"}, "prompt_lookup_min", "a positive"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min", "a positive"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3.0}, "prompt_lookup_max", "a positive"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": "1"},
     "draft_tensor_parallel_size", "a positive integer"),
    ({"method": 5, "num_speculative_tokens": 3}, "method", "a string"),
    ({"method": "draft_model", "model": 5, "num_speculative_tokens": 3}, "model", "a path"),
    ({"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 3,
      "eagle_aux_hidden_state_layer_ids": "0,1,2"}, "eagle_aux_hidden_state_layer_ids", "a list of integers"),
    ({"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 3,
      "eagle_aux_hidden_state_layer_ids": [0, 1.5]}, "eagle_aux_hidden_state_layer_ids", "a list of integers"),
]


@pytest.mark.parametrize(("config", "key", "rule"), BAD_SPECULATIVE)
def test_bad_speculative_config_value_is_refused_by_key(config, key, rule):
    with pytest.raises(ValueError, match=rf"^speculative_config\['{key}'\] must be {rule}.*, got "):
        check_speculative_config(config)


def test_speculative_config_names_valid_methods_and_keys_and_normalizes():
    with pytest.raises(ValueError, match=r"unknown speculative method 'nope'; choose one of \[.*'ngram'"):
        check_speculative_config({"method": "nope", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) \['k'\] for 'ngram'; valid ones"):
        check_speculative_config({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        check_speculative_config("ngram")
    config = check_speculative_config({"model": "[ngram]", "num_speculative_tokens": np.int64(3),
                                       "prompt_lookup_min": None})
    assert config == {"method": "ngram", "model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_min": None}
    assert type(config["num_speculative_tokens"]) is int
    # a method's own keys come with its registration, each with a kind
    assert _METHOD_KEYS["ngram"] == {"prompt_lookup_min": "posint?", "prompt_lookup_max": "posint?"}


BAD_EPLB = {
    "policy": [5, None],
    "step_interval": ["100", 1.5, True, -1],
    "window_size": ["1000", 0],
    "max_rebalances": [1.0, -1],
    "num_ep_ranks": ["2", 0],
    "num_nodes": [True, 0],
    "num_redundant_experts": [2.0, -1],
    "record_trace": [5, True],
    "expert_parallel": ["false", 1, None],
    "dispatch": [1, None],
    "rebalance_layers_per_chunk": [0, "2"],
    "nvlink_gbps": ["450", True],
    "ib_gbps": [float("nan"), -1.0],
}


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, values in BAD_EPLB.items() for v in values])
def test_bad_eplb_config_value_is_refused_by_key(key, value):
    with pytest.raises(ValueError, match=rf"^eplb\.{key} must be .*, got {re.escape(repr(value))}$"):
        EplbSettings.from_dict({key: value})


def test_eplb_config_names_valid_policies_and_keys_and_normalizes():
    assert set(BAD_EPLB) == set(EplbSettings.__dataclass_fields__)
    with pytest.raises(ValueError, match=r"unknown EPLB policy 'magic'; choose one of \[.*'deepseek'"):
        EplbSettings.from_dict({"policy": "magic"})
    with pytest.raises(ValueError, match=r"unknown eplb config key\(s\) \['polcy'\]; known: \[.*'policy'"):
        EplbSettings.from_dict({"polcy": "lpt"})
    with pytest.raises(ValueError, match="eplb_config must be a dict"):
        EplbSettings.from_dict("deepseek")
    with pytest.raises(ValueError, match=r"num_ep_ranks \(3\) must divide by num_nodes \(2\)"):
        EplbSettings.from_dict({"num_ep_ranks": 3, "num_nodes": 2})
    s = EplbSettings.from_dict({"num_ep_ranks": np.int64(4), "max_rebalances": None})
    assert s.num_ep_ranks == 4 and type(s.num_ep_ranks) is int


def test_shipped_configs_pass():
    for f in sorted((CONF / "eplb").glob("*.yaml")):
        EplbSettings.from_dict(yaml.safe_load(f.read_text()))
    for f in sorted((CONF / "spec").glob("*.yaml")):
        spec = yaml.safe_load(f.read_text())
        if spec.get("method"):  # spec=none has no method: the experiment passes no speculative_config
            check_speculative_config(spec)


def test_llm_refuses_bad_configs_before_loading_any_weights():
    """The checkpoint does not exist: the config error must come first, so it came before any loading."""
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\] must be a positive"):
        LLM("/nonexistent/checkpoint", device="cpu",
            speculative_config={"method": "ngram", "num_speculative_tokens": "abc"})
    with pytest.raises(ValueError, match=r"eplb\.num_ep_ranks must be a positive integer, got '2'"):
        LLM("/nonexistent/checkpoint", device="cpu", eplb_config={"num_ep_ranks": "2"})


def test_llm_still_generates_after_a_bad_request():
    llm = LLM("tiny-llama", device="cpu", max_model_len=64, seed=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"SamplingParams\.seed must be an integer or None, got 'abc'"):
        llm.generate([[5, 6, 7]], SamplingParams(seed="abc"), use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs must be a non-negative integer or None"):
        SamplingParams(logprobs=2.5)
    outs = llm.generate([[5, 6, 7], [8, 9]], [params, SamplingParams(seed=np.int64(7), max_tokens=3, logprobs=2)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == before and len(before) == 4
    assert len(outs[1].outputs[0].token_ids) >= 1 and outs[1].outputs[0].logprobs is not None
    assert not llm.engine.has_unfinished_requests()


def test_a_value_of_the_wrong_type_is_both_a_type_error_and_a_value_error():
    from research_lm.api.config import EngineConfig

    for build in (lambda: SamplingParams(seed="abc"), lambda: SamplingParams(logprobs=2.5),
                  lambda: EngineConfig(max_num_seqs="abc")):
        with pytest.raises(TypeError):
            build()
        with pytest.raises(ValueError):
            build()
