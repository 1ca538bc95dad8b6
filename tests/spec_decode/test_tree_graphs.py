"""A token tree's drafting step (the entry forward and the levels) from graphs (spec_decode/tree_graphs.py), static
and dynamic, against the eager step.

On CPU the graph is stood in for by a re-run over the same persistent buffers (`eager_capture`), with the Triton
attention kernels under the interpreter: every step's drafts (and a dynamic tree's parents) must equal the eager
tree's (the entry's rows vary with acceptance; the roots, the levels' positions, KV slots, ancestor masks and parent
features come from the entry inside the graph, a dynamic tree's real nodes from the staged chain budgets), over
padded and shrinking batches, and so the outputs too; and the entry must run eagerly only for the first rows of
entries longer than a graph takes (the prompts beside others), or not at all where a prompt graph takes the prompt.
The GPU test captures real graphs.
"""

from __future__ import annotations

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.worker.cuda_graphs import cuda_graph_capture, eager_capture
from spec_decode.tree_graphs import TreeGraphs
from tests.spec_decode.spying import record_drafts
from tests.spec_decode.test_eagle_tree import BRANCHING, SHIPPED, TEXTS

KNOBS = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
             attention_backend="triton", enable_prefix_caching=False, cuda_graphs=False)
# different lengths: the batch shrinks 4 -> 3 (padded to 4) -> 2 -> 1
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 8, 10, 12)]


TREES = {"static": {"speculative_token_tree": BRANCHING},
         "dynamic": {"num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 10}}


def _parents(proposer) -> list:
    """Every tree drafting call's parents (a dynamic tree's own; None for a static one), as host lists."""
    calls, propose = [], proposer.propose

    def spy(outcome):
        drafts = propose(outcome)
        calls.append(None if drafts.tree_parents is None else drafts.tree_parents.tolist())
        return drafts

    proposer.propose = spy
    return calls


def _eager_entries(proposer) -> list:
    """The entry lengths of every eager entry forward (`EagleProposer._entry`) of the proposer."""
    calls, entry = [], proposer._entry

    def spy(outcome, rows, starts, lens, *rest):
        calls.append(list(lens))
        return entry(outcome, rows, starts, lens, *rest)

    proposer._entry = spy
    return calls


def _graph_llm(device: str, capture, tree: dict, prefill_sizes=()) -> tuple[LLM, list[int], list]:
    """An LLM whose tree steps replay graphs of sizes 1, 2 and 4; the entry requests of each replay; the eager
    entry forwards."""
    llm = LLM("tiny-llama", device=device, **KNOBS, speculative_config={**SHIPPED, **tree})
    runner = llm.engine.runner
    runner.proposer.capture_cuda_graphs(sizes=[1, 2, 4], capture=capture, block_size=runner.block_size,
                                        max_blocks_per_req=runner.buffers.block_table.gpu.shape[1],
                                        prefill_sizes=prefill_sizes)
    graphs, replays = runner.proposer.tree_graphs, []
    assert isinstance(graphs, TreeGraphs) and graphs.sizes == [1, 2, 4]
    run = graphs.run
    graphs.run = lambda block_table, rows, *rest, **kw: replays.append(len(rows)) or run(block_table, rows, *rest,
                                                                                          **kw)
    return llm, replays, _eager_entries(runner.proposer)


def _check(device: str, capture, tree: dict) -> None:
    prompts = TEXTS[:4]
    eager = LLM("tiny-llama", device=device, **KNOBS, speculative_config={**SHIPPED, **tree})
    want_parents = _parents(eager.engine.runner.proposer)
    want_drafts, _ = record_drafts(eager.engine.runner.proposer)
    want_entries = _eager_entries(eager.engine.runner.proposer)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, PARAMS, use_tqdm=False)]
    llm, replays, entries = _graph_llm(device, capture, tree)
    parents = _parents(llm.engine.runner.proposer)
    drafts, _ = record_drafts(llm.engine.runner.proposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert got == want  # (greedy trees against plain greedy: tests/spec_decode/test_eagle_tree.py)
    assert drafts == want_drafts and len(drafts) > 0 and parents == want_parents
    static = "speculative_token_tree" in tree
    assert all(p is None for p in parents) if static else sum(p is not None for p in parents) > 3
    assert 3 in replays and 1 in replays  # padded (3 -> 4) and single-request replays both ran
    # The entry replays with the levels: eagerly only the prompts' first rows (4 prompts: no prompt graph), each
    # longer than a graph's q = depth + 1 rows, which the graph then enters.
    assert len(want_entries) == len(replays) > len(entries) and entries
    assert len(entries) == 1 and len(entries[0]) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("tree", TREES)
def test_graph_levels_draft_what_the_eager_levels_draft(tree):
    _check("cpu", eager_capture, TREES[tree])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant")
@pytest.mark.parametrize("tree", TREES)
def test_a_prompt_graph_enters_the_prompt(tree):
    """One request: its prompt enters through a prompt graph (B = 1, q = 16) and every later entry through the tree's
    graphs, so no entry forward runs eagerly; the drafts are the eager step's."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eager = LLM("tiny-llama", device="cpu", **KNOBS, speculative_config={**SHIPPED, **TREES[tree]})
    want_drafts, _ = record_drafts(eager.engine.runner.proposer)
    want = eager.generate(TEXTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    llm, replays, entries = _graph_llm("cpu", eager_capture, TREES[tree], prefill_sizes=[16, 32])
    drafts, _ = record_drafts(llm.engine.runner.proposer)
    got = llm.generate(TEXTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and drafts == want_drafts and len(drafts) > 1
    assert entries == [] and len(replays) >= len(drafts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree", TREES)
def test_on_cuda_graph_levels_draft_what_the_eager_levels_draft(tree):
    _check("cuda", cuda_graph_capture, TREES[tree])
