"""The head a speculative run drafted with, and the notes the run writes on its own numbers: where the head came
from (`head_record`), whether it is a quick one (`quick_head_note`), and why a speedup stayed low
(`speculation_note`). harness.experiment resolves the head (`with_spec_head`) and writes both to results.json.
"""

from __future__ import annotations

import json
from typing import Any

from research_lm.assets import ASSETS
from research_lm.models import CheckpointError, resolve_model_path

# spec.method -> the training preset that writes its head (conf/experiment/<preset>.yaml, train.output_dir)
SPEC_HEAD_PRESETS = {"eagle3": "train_eagle3", "eagle": "train_eagle", "medusa": "train_medusa",
                     "draft_model": "train_draft"}


def head_record(method: str, model: str, source: str, steps: int | None = None,
                recipe_steps: int | None = None) -> dict[str, Any]:
    """What drafted, for results.json and the report: `source` is shipped (a built-in head), given (spec.model),
    trained (on the fly, by this run) or reused (the head an earlier run or training preset wrote);
    `train_steps` is `steps`, else the head's recipe.json's (None without one); `recipe_steps` the training
    preset's own step count, for a head it wrote (a head trained for fewer is a quick one)."""
    try:
        path = resolve_model_path(model)
    except CheckpointError:  # a missing head fails later, in the engine, with its own message
        path = None
    if source == "given" and path is not None and path.resolve().parent == ASSETS:
        source = "shipped"
    if steps is None and path is not None and (path / "recipe.json").is_file():
        steps = json.loads((path / "recipe.json").read_text()).get("steps")
    return {"method": method, "model": str(model), "source": source, "train_steps": steps,
            "recipe_steps": recipe_steps}


def quick_head_note(head: dict[str, Any] | None) -> str | None:
    """A note when the head was trained for fewer steps than its training preset runs: its acceptance (and so the
    speedup) understates what the method does with a trained head."""
    if not head or head.get("source") not in ("trained", "reused"):
        return None
    steps, full = head.get("train_steps"), head.get("recipe_steps")
    if steps is None or full is None or steps >= full:
        return None
    return (f"the {head['method']} head ({head['model']}) is a quick one, {steps} training steps against the "
            f"{full} of experiment={SPEC_HEAD_PRESETS[head['method']]}: its acceptance understates a trained head's")


SPEEDUP_NOTE_BELOW = 1.1  # a speculative run slower than this x its baseline gets a note saying why
# a rule of thumb: from this batch on the note takes a verify step's k + 1 tokens per request to cost more than 1
# token's; below it a step is mostly fixed costs (launches, host work), whatever its tokens
COMPUTE_BOUND_BATCH = 8
# why a head step is dear next to a small target: both steps are mostly fixed per-layer costs, not arithmetic
_LAUNCH_BOUND = "at this size a head step, like a target step, is mostly launches and host work, not arithmetic"


def speculation_note(summary: dict[str, Any], k: int, method: str | None) -> str | None:
    """Why speculation did not pay off in this run, from what the run measured (its summary after
    compare_to_baseline; k = spec.num_speculative_tokens; method = spec.method). None without a speedup and a tau
    to explain, or when the speedup reaches SPEEDUP_NOTE_BELOW. A speculative decode step emits tau tokens per
    request where a plain one emits one, so it pays only where tau exceeds its cost in plain steps (the decode step
    ratio). The note states both, then the first reason that applies: decoding pays (time per output token) but
    prefills take the gain; the decode steps pay at their median but not over the run; few drafts are accepted;
    else where the step's extra time goes: from the draft and verify phase times where they were timed on most
    decode steps (asynchronous steps run ahead untimed), else from the batch and the method (below
    COMPUTE_BOUND_BATCH a verify forward costs about one plain step, so a model drafter's steps are the rest; a
    drafter without a model, ngram, adds only the speculative step's own host work)."""
    speedup, tau = summary.get("speedup"), summary.get("mean_acceptance_length")
    if speedup is None or tau is None or speedup >= SPEEDUP_NOTE_BELOW:
        return None
    text = f"speedup {speedup:.2f} (< {SPEEDUP_NOTE_BELOW}) at tau {tau:.2f} of at most {k + 1}"
    spec_ms, base_ms = summary.get("decode_step_ms_median"), summary.get("baseline_decode_step_ms_median")
    if not spec_ms or not base_ms:
        return text + "; the run measured no pure decode steps to say why."
    cost, batch, extra = spec_ms / base_ms, summary.get("decode_batch_mean") or 0.0, spec_ms - base_ms
    text += (f": at batch {batch:.3g} a speculative decode step takes {spec_ms:.3g} ms = {cost:.2f} plain steps of "
             f"{base_ms:.3g} ms, so it pays only where tau > {cost:.2f}. ")
    tpot, ttft = summary.get("tpot_ratio"), summary.get("ttft_ratio")
    model = method in SPEC_HEAD_PRESETS  # a model drafts (a head, a draft model); else drafts are looked up (ngram)
    if tpot and tpot * SPEEDUP_NOTE_BELOW <= 1:
        if ttft and ttft >= SPEEDUP_NOTE_BELOW:
            return text + (f"Decoding pays ({1 / tpot:.2f}x faster per output token) and the prefills take the gain: "
                           f"time to first token is {ttft:.2f}x the baseline's"
                           + (" (the drafter reads every prompt too)." if model else "."))
        return text + (f"Decoding pays ({1 / tpot:.2f}x faster per output token"
                       + (f", time to first token {ttft:.2f}x the baseline's" if ttft else "")
                       + "), so what takes the gain lies outside both: e.g. the slowest request's tail, or kernels "
                       "compiled in the measured window (warmup_requests=0).")
    if tau >= cost:
        return text + (f"Its decode steps pay at their median ({tau / cost:.2f}x) but not over the run"
                       + (f" ({1 / tpot:.2f}x per output token)" if tpot else "")
                       + ": slower steps than the median, or steps without drafts, take the gain.")
    if (tau - 1) / max(k, 1) < 0.35:
        return text + f"Acceptance is the limit: {tau - 1:.2f} of {k} drafts accepted per step."
    draft, verify = summary.get("draft_ms_per_step_median"), summary.get("verify_ms_per_step_median")
    timed, steps = summary.get("num_verify_steps") or 0, summary.get("num_decode_steps") or 0
    if draft is not None and verify is not None and timed >= 0.5 * steps:  # the phases tell where the time goes
        if draft >= verify - base_ms:
            per = draft / max(k, 1) / base_ms
            return text + (f"Drafting is the cost: {k} drafts take {draft:.3g} ms = {draft / base_ms:.2f} plain "
                           f"steps, {per:.2f} per draft" + (f"; {_LAUNCH_BOUND}." if model else "."))
        why = ("the target computes k + 1 tokens per request instead of 1, and at this batch its step grows with "
               "them" if batch >= COMPUTE_BOUND_BATCH else "at this batch k + 1 tokens cost a target forward about "
               "what 1 does, so the rest is verification's host work")
        return text + (f"Verifying is the cost: {verify:.3g} ms = {verify / base_ms:.2f} plain steps (drafting "
                       f"{draft:.3g} ms); {why}.")
    untimed = f" (draft and verify were timed apart on {timed} of {steps} decode steps only)"
    if batch >= COMPUTE_BOUND_BATCH:
        return text + (f"The extra {extra:.3g} ms pays for {k} drafts and a verify forward over {k + 1} tokens per "
                       f"request, dearer than a 1-token step at this batch{untimed}.")
    if not model:
        return text + (f"Its drafts need no model, so the extra {extra:.3g} ms = {extra / base_ms:.2f} plain steps "
                       f"is the speculative step's own work (verifying, bookkeeping) beside a target step this "
                       f"short{untimed}.")
    per = extra / max(k, 1) / base_ms  # > (tau - 1) / k >= 0.35 here: drafting is most of the extra
    return text + (f"At this batch a verify forward costs about one plain step, so the extra {extra:.3g} ms is "
                   f"drafting: {per:.2f} plain steps per draft token; {_LAUNCH_BOUND}{untimed}.")
