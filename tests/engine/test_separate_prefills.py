"""`separate_prefills`: a short prompt arriving while others decode runs in a step of its own. Only the steps
change, never the tokens: greedy and seeded sampling give the same outputs with the policy on and off, for
plain decoding (synchronous and async) and for speculative decoding, and the solo steps really happen."""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams

KNOBS = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=3, max_model_len=96)
LENS, MAX_TOKENS = (3, 17, 8, 30, 5, 12, 21), (5, 9, 12, 3, 7, 10, 4)


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in LENS]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    return prompts, params


def _generate(model: str, separate: bool, **knobs):
    llm = LLM(model, separate_prefills=separate, **(KNOBS | knobs))
    prompts, params = _workload(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _solo_steps(llm: LLM) -> int:
    """Steps that computed one request's prompt while others were running (and were not scheduled)."""
    return sum(1 for s in llm.engine.metrics.steps
               if s["num_reqs"] == 1 and s["num_scheduled_tokens"] > 1 + s["num_draft_tokens"]
               and s["num_running"] > 1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_plain_decoding_emits_the_same_tokens_with_prompts_in_their_own_steps(tiny_checkpoint, asynchronous):
    path = str(tiny_checkpoint("llama"))
    off, want = _generate(path, False, device="cpu", async_scheduling=asynchronous)
    on, got = _generate(path, True, device="cpu", async_scheduling=asynchronous)
    assert got == want
    assert on.engine.scheduler.separate_prefill_tokens == KNOBS["max_num_batched_tokens"]
    assert _solo_steps(on) >= 3 and _solo_steps(off) == 0


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculative_decoding_emits_the_same_tokens_with_prompts_in_their_own_steps(method):
    """The running requests' drafts wait on the device through the solo step and are verified after it."""
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= {"model": "tiny-llama-eagle3"} if method == "eagle3" else {"prompt_lookup_min": 1}
    _, want = _generate("tiny-llama", False, device="cpu")
    off, got_off = _generate("tiny-llama", False, device="cpu", speculative_config=spec)
    on, got = _generate("tiny-llama", True, device="cpu", speculative_config=spec)
    assert got == got_off
    assert got[::2] == want[::2]  # the greedy rows: as without drafts
    assert _solo_steps(on) >= 3 and _solo_steps(off) == 0
    assert sum(s["num_draft_tokens"] for s in on.engine.metrics.steps) > 0


def test_the_default_follows_the_prefill_graphs(tiny_checkpoint):
    """None (the default): on only where prefill graphs were captured, so never on a CPU."""
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", **KNOBS)
    assert llm.engine.scheduler.separate_prefill_tokens == 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", [None, "eagle3"])
def test_on_cuda_the_solo_prompt_replays_a_prefill_graph_and_tokens_match(method):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 3} if method else None
    knobs = dict(device="cuda", attention_backend="triton", cuda_graphs=True, speculative_config=spec)
    _, want = _generate("tiny-llama", False, **knobs)
    llm = LLM("tiny-llama", **(KNOBS | knobs))  # separate_prefills None: on, up to the longest prefill graph
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.prefill
    assert llm.engine.scheduler.separate_prefill_tokens == max(graphs.prefill)
    prompts, params = _workload(llm.engine.info.vocab_size)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert _solo_steps(llm) >= 3
