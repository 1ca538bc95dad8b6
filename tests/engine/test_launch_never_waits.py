"""A launched step never waits for the device: once warm, `ModelRunner.launch` runs under
torch.cuda.set_sync_debug_mode("error"), for plain decoding and for n-gram speculation (drafts looked up, verified
and written into the token table on the device). `collect` is the step's one sync."""

from __future__ import annotations

import pytest
import torch

from research_lm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROFILE = {"source": "a test's rates", "num_speculative_tokens": 3, "per_position": [0.8, 0.6, 0.5]}


@pytest.mark.gpu
@pytest.mark.parametrize("spec, replay", [(None, None), (NGRAM, None), (NGRAM, PROFILE)],
                         ids=["plain", "ngram", "ngram-replayed"])
def test_launch_never_syncs_on_cuda(spec, replay):
    """(With acceptance replay too: its counts are drawn and applied on the device.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM("tiny-llama", device="cuda", max_num_seqs=4, speculative_config=spec, acceptance_replay=replay)
    engine, runner = llm.engine, llm.engine.runner
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 10], [11, 12, 13, 11, 12, 13], [14, 15, 16, 17]]
    for p in prompts:  # the same length each: the batch stays whole, its input kernel replays one small graph
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    launch, strict = runner.launch, []

    def launch_strictly(sched):
        if len(strict) < 8:  # warm-up: kernels compile, the input kernel's graph is captured
            strict.append(False)
            return launch(sched)
        strict.append(True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = launch_strictly
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(strict) >= 5
    if spec is not None:
        assert engine.metrics.summary()["draft_acceptance_rate"] > 0
