"""A step the runner launched and has not collected: what `ModelRunner.collect` needs to finish it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from research_lm.api.outputs import RunnerOutput, SchedulerOutput
from research_lm.worker.sampler import SamplerOutput, SamplingBatch
from research_lm.worker.spec import Drafts, StepOutcome
from research_lm.worker.step_inputs import StepInputs


@dataclass
class PendingStep:
    """A launched step: its output when already known (an empty step), else what `collect` needs."""

    sched: SchedulerOutput
    output: RunnerOutput | None = None
    inputs: StepInputs | None = None
    outcome: StepOutcome | None = None
    host: torch.Tensor | None = None  # [n * m + 2n] int64 pinned: emitted, their counts, real drafts verified
    copied: torch.cuda.Event | None = None
    logits: torch.Tensor | None = None  # kept for logprobs
    batch: SamplingBatch | None = None
    sampled: SamplerOutput | None = None  # plain sampling's, for its logprobs
    drafted: Drafts | None = None  # drafted at launch, on the device
    num_proposed: dict[str, int] | None = None  # then: request id -> draft slots of its next step (their count)
    verifies: bool = False
    packed_rows: int = 0  # requests in `host`'s layout (a graph's padded batch, or the step's)
    t0: float = 0.0
    draft_ms: float | None = None
