"""sim_spec_oracle (issue 36) on CPU: acceptance of a path and of a speculation tree against the truth, a proposer
that drafts the truth reaching k + 1 tokens a step, and the registered table's smoke run."""

from __future__ import annotations

import sys

from experiments import paper
from tests.experiments.conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import sim_spec_oracle as sim  # noqa: E402  (experiments/ is a folder of scripts, not a package)


def test_a_path_keeps_its_matching_prefix_and_a_tree_its_deepest_matching_path():
    assert sim.accepted([5, 6, 7], None, [5, 6, 9, 9]) == 2
    assert sim.accepted([5, 6], None, [5]) == 1  # the truth runs out
    # root -> 5 (node 1) and 4 (node 2); 5 -> 6 (node 3) and 8 (node 4); 8 -> 9 (node 5)
    tokens, parents = [5, 4, 6, 8, 9], [0, 0, 1, 1, 4]
    assert sim.accepted(tokens, parents, [5, 8, 9, 1]) == 3 and sim.accepted(tokens, parents, [4, 6]) == 1
    assert sim.accepted(tokens, parents, [7]) == 0 and sim._depth(parents, 5) == 3


class _Truth:
    """Drafts the next k tokens of the answer: every draft accepted."""

    def __init__(self, pairs, k):
        self.answers, self.k = {i: a for i, (_, a) in enumerate(pairs)}, k

    def draft(self, rid, context, known):
        done = len(context) - self.prompt_lens[rid]
        return self.answers[rid][done : done + self.k], None

    def finish(self, rid, answer):
        pass


def test_a_proposer_that_drafts_the_truth_emits_k_plus_one_tokens_a_step():
    pairs = [([1, 2, 3], list(range(10, 30))), ([4, 5], list(range(40, 47)))]
    truth = _Truth(pairs, 4)
    truth.prompt_lens = {i: len(p) for i, (p, _) in enumerate(pairs)}
    row = sim.simulate(truth, pairs)
    assert row["tau"] == (20 + 7) / (4 + 2)  # 20 tokens in 4 steps of 5, 7 in 5 + 2
    assert row["accepted_fraction"] == 1.0 and row["accept_1"] == 1.0


def test_the_registered_smoke_run_has_every_proposer(tmp_path):
    payload = sim.main([*paper.TABLES["sim_spec_oracle"].smoke, "--out", str(tmp_path)])
    rows = {r["proposer"]: r for r in payload["rows"]}
    assert list(rows) == [label for label, *_ in sim.PROPOSERS] and payload["requests"] == 8
    assert all(1 <= r["tau"] <= 25 for r in rows.values())
    assert rows["suffix k=24 (vLLM's default)"]["drafts_per_step"] > rows["suffix k=5"]["drafts_per_step"]
    assert "| suffix k=5, tree |" in (tmp_path / "sim_spec_oracle.md").read_text()
