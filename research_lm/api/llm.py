"""`LLM`: the offline batch API, with vLLM's names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from research_lm.api.config import EngineConfig
from research_lm.api.outputs import RequestOutput, merge_completions
from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.llm_engine import LLMEngine

_KNOBS = {f.name for f in fields(EngineConfig)}


class LLM:
    """`LLM(model="tiny-llama", dtype="float32", block_size=16, ...)`; every knob is an `EngineConfig` field,
    plus vLLM's `enforce_eager=True` (no CUDA graphs, no torch.compile). With `tensor_parallel_size=N` the script
    runs under `torchrun --nproc-per-node N`, every rank building its `LLM` alike (engine/distributed.py)."""

    def __init__(self, model: str = "tiny-llama", *, enforce_eager: bool = False, **kwargs: Any):
        unknown = sorted(set(kwargs) - _KNOBS)
        if unknown:
            valid = sorted((_KNOBS - {"model"}) | {"enforce_eager"})
            raise ValueError(f"unknown LLM argument(s) {unknown}; valid ones: {valid}")
        if enforce_eager:
            forced = [k for k in ("cuda_graphs", "compile") if kwargs.get(k)]
            if forced:
                raise ValueError(f"enforce_eager=True contradicts {', '.join(f'{k}=True' for k in forced)}")
            kwargs |= {"cuda_graphs": False, "compile": False}
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Sequence[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
            )
        order = {}  # request id -> (prompt index, completion index): n > 1 runs as n requests
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            for c, child in enumerate(params.children()):
                order[self.engine.add_request(prompt, child).request_id] = (i, c)
        results: list[list[RequestOutput | None]] = [[None] * p.n for p in sampling_params]
        with tqdm(total=len(order), desc="generate", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in order:
                        i, c = order[out.request_id]
                        results[i][c] = out
                        bar.update(1)
        return [r[0] if len(r) == 1 else merge_completions(r) for r in results]  # type: ignore[arg-type]


def _as_prompt_list(prompts) -> list[str | list[int]]:
    """Strings, token-id lists, or vLLM's prompt dicts ({"prompt": str} / {"prompt_token_ids": [int]})."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return [_one_prompt(p) for p in prompts]


def _one_prompt(p) -> str | list[int]:
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
    return list(p)
