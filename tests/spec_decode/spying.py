"""Test helpers that read what a proposer drafted: the values of its `Drafts` and each request's context, both from
the device (the runner never waits for them; a test may)."""

from __future__ import annotations

from research_lm.worker.spec import Drafts, StepOutcome


def draft_values(outcome: StepOutcome, drafts: Drafts) -> dict[str, list[int]]:
    """Request id -> its real drafts ([] where it drafted none); drafts the proposer wrote into the token table
    (`Drafts.in_table`) are read from there: the real ones after each request's tokens."""
    out = {r.request_id: [] for r in outcome.requests}
    if drafts.in_table:
        table = outcome.tokens
        for i in drafts.index:
            row = int(table.rows[i])
            start, num = int(table.num_tokens[row]), int(table.num_drafts[row])
            out[outcome.requests[i].request_id] = table.token_ids[row, start : start + num].tolist()
        return out
    k = drafts.token_ids.shape[1]
    nums = drafts.num if drafts.num is not None else [k] * len(drafts.index)
    nums = nums.tolist() if hasattr(nums, "tolist") else nums
    for i, row, n in zip(drafts.index, drafts.token_ids.tolist(), nums, strict=True):
        out[outcome.requests[i].request_id] = row[:n]
    return out


def context(outcome: StepOutcome, i: int) -> list[int]:
    """Request i's tokens in the device table: its prompt and outputs, this step's emitted ones included."""
    row = int(outcome.tokens.rows[i])
    return outcome.tokens.token_ids[row, : int(outcome.tokens.num_tokens[row])].tolist()


def record_drafts(proposer, keep=lambda request: request.sampling_params.greedy):
    """Wrap both of the proposer's entry points; returns (records, on_device): (context, drafts) of every request
    `keep` accepts that drafted, and per drafting call whether it ran at launch (`propose_on_device`)."""
    records, on_device = [], []
    for name in ("propose_on_device", "propose"):
        real = getattr(proposer, name)

        def spy(outcome, real=real, name=name):
            drafts = real(outcome)
            if drafts is not None:
                on_device.append(name == "propose_on_device")
                values = draft_values(outcome, drafts)
                for i, req in enumerate(outcome.requests):
                    if values[req.request_id] and keep(req):
                        records.append((context(outcome, i), values[req.request_id]))
            return drafts

        setattr(proposer, name, spy)
    return records, on_device
