"""Model-based proposers launch ahead under async scheduling, as n-gram lookup does
(tests/engine/test_async_scheduling.py): a plain-greedy verify step drafts on the device right behind its
verification, from the "verified" draft graph, which writes the drafts into the runner's token table; the engine then
launches the next verify step before it collects this one, on counts that assume every draft accepted. The GPU test
captures real graphs, as the runner does, with the built-in tiny pair, which drafts well enough to accept some drafts,
not all: tiny-llama with its trained EAGLE-3 head, or with a perturbed copy of itself as the draft model. On CPU the
same launch-ahead with equal counts is test_draft_graphs.py's
test_async_scheduling_launches_the_next_verify_step_before_verifying (graphs re-run over their buffers)."""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.models.loader import resolve_model_path
from tests.spec_decode.test_draft_graphs import KNOBS, K
from tests.spec_decode.test_draft_model import _variant

TARGET = "tiny-llama"


def _spec(kind: str, tmp_path) -> dict:
    if kind == "eagle3":
        return {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": K}
    noisy = torch.Generator().manual_seed(0)
    draft = _variant(resolve_model_path(TARGET), tmp_path / "draft",
                     lambda name, w: w + 0.02 * torch.randn(w.shape, generator=noisy) if w.dim() == 2 else w)
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


def _check_launched_ahead(llm: LLM, sync: LLM, plain: LLM) -> list[bool]:
    """Five greedy requests, four at a time (the fifth comes in when the first finishes: its prompt steps draft at
    collect, and the others re-enter from the target's computed tokens then): `plain`'s tokens, `sync`'s tokens,
    draft and acceptance counts, and every block back. Per collected step, whether the next was launched first."""
    engine, ahead = llm.engine, []
    collect = engine.runner.collect
    engine.runner.collect = lambda pending: ahead.append(engine._in_flight is not None) or collect(pending)
    rng = random.Random(11)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (5, 9, 4, 7, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 8, 12, 7, 5)]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = sync.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in got]
    assert tokens == [o.outputs[0].token_ids for o in want]
    assert tokens == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.metrics.num_draft_tokens for o in got] == [o.metrics.num_draft_tokens for o in want]
    assert [o.metrics.num_accepted_tokens for o in got] == [o.metrics.num_accepted_tokens for o in want]
    accepted, drafted = sum(o.metrics.num_accepted_tokens for o in got), sum(o.metrics.num_draft_tokens for o in got)
    assert 0 < accepted < drafted
    assert engine.kv_cache.num_free_blocks == engine.num_blocks - 1
    return ahead


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_verify_steps_are_launched_ahead_on_cuda(kind, tmp_path):
    """Real graphs, async scheduling on (the CUDA defaults): the runner hands its token table to the drafter's
    "verified" graphs at capture; the same checks as the interpreter variant."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    knobs, spec = KNOBS | dict(device="cuda"), _spec(kind, tmp_path)
    llm = LLM(TARGET, speculative_config=spec, **knobs)
    assert llm.engine.async_scheduling and llm.engine.runner.proposer.graphs.drafts_verified
    ahead = _check_launched_ahead(llm, LLM(TARGET, async_scheduling=False, speculative_config=spec, **knobs),
                                  LLM(TARGET, cuda_graphs=False, **knobs))
    assert sum(ahead) >= len(ahead) // 2
