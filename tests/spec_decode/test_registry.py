"""Proposers reach the core only through its registry: research_lm never names spec_decode; spec_decode's methods
come in through the "research_lm.proposers" entry point; a proposer registered with `register_proposer` alone is
built by the engine like the shipped ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import research_lm
from research_lm import LLM, SamplingParams
from research_lm.worker.spec import (
    _METHOD_KEYS,
    PROPOSERS,
    Drafts,
    DraftTarget,
    Proposer,
    StepOutcome,
    build_proposer,
    register_proposer,
)

METHODS = ["deepseek_mtp", "draft_model", "eagle", "eagle3", "medusa", "mtp", "ngram", "suffix"]
_NAMES_SPEC_DECODE = re.compile(r"^\s*(import|from)\s+spec_decode\b|[\"']spec_decode\.", re.M)


def test_research_lm_never_names_spec_decode():
    root = Path(research_lm.__file__).parent
    found = [f"{path.relative_to(root.parent)}:{source.count(chr(10), 0, m.start()) + 1}"
             for path in sorted(root.rglob("*.py"))
             for source in [path.read_text()]
             for m in _NAMES_SPEC_DECODE.finditer(source)]
    assert not found, f"research_lm imports the spec_decode plugin: {found}"


def test_the_registry_lists_the_shipped_methods():
    assert set(METHODS) <= set(PROPOSERS.names())
    assert all(method in PROPOSERS for method in METHODS)


def test_an_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown speculative method 'nope'; choose one of \[") as e:
        build_proposer({"method": "nope", "num_speculative_tokens": 2}, None)
    assert all(repr(method) in str(e.value) for method in METHODS)


class _RepeatLast(Proposer):
    """Drafts each request's last emitted token k times: often wrong, sometimes right. Only `propose` is required."""

    def __init__(self, k: int) -> None:
        self.num_speculative_tokens = k

    def propose(self, outcome: StepOutcome) -> Drafts:
        index = [i for i, e in enumerate(outcome.emitted) if e]
        k = self.num_speculative_tokens
        return Drafts.from_lists(index, [[outcome.emitted[i][-1]] * k for i in index], k, outcome.input_ids.device)


@pytest.fixture
def toy_method():
    """A method registered here, out of the registry again afterwards."""
    built = []

    @register_proposer("toy", toy_width="posint?")  # a key of its own, declared here alone
    def build_toy(speculative_config, target):
        built.append(target)
        return _RepeatLast(int(speculative_config["num_speculative_tokens"]))

    try:
        yield built
    finally:
        PROPOSERS.entries.pop("toy", None)
        _METHOD_KEYS.pop("toy", None)


def test_a_registered_proposer_is_built_without_editing_research_lm(toy_method):
    assert "toy" in PROPOSERS.names()
    proposer = build_proposer({"method": "toy", "num_speculative_tokens": 2, "toy_width": 3}, "target")
    with pytest.raises(ValueError, match=r"speculative_config\['toy_width'\] must be a positive integer"):
        build_proposer({"method": "toy", "num_speculative_tokens": 2, "toy_width": "wide"}, "target")
    assert isinstance(proposer, _RepeatLast) and proposer.num_speculative_tokens == 2 and toy_method == ["target"]


def test_the_engine_decodes_with_a_registered_proposer(toy_method, tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                 max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 7, 9, 11]]
    want = [o.outputs[0].token_ids for o in LLM(path, **knobs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **knobs, speculative_config={"method": "toy", "num_speculative_tokens": 2})
    outs = llm.generate(prompts, params, use_tqdm=False)
    target = toy_method[0]  # what a factory is given: a description of the target, never the engine
    assert len(toy_method) == 1 and isinstance(target, DraftTarget) and target.vocab_size == llm.engine.info.vocab_size
    assert target.compute_logits == llm.engine.model.compute_logits
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
