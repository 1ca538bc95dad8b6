"""The engine's configuration: one plain dataclass with vLLM's knob names. Hydra fills it from conf/."""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from research_lm.api.checks import InvalidType, describe_annotation, matches_annotation
from research_lm.ops import SKINNY_MAX_ROWS

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "float": torch.float32, "half": torch.float16}


_BATCH_LIMITS = {"cuda": (256, 16384), "cpu": (64, 2048)}  # device -> (max_num_seqs, max_num_batched_tokens)
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's name: "1" turns `batch_invariant` on


@dataclass
class EngineConfig:
    model: str = "tiny-llama"  # a checkpoint dir or a built-in name (research_lm.assets)
    tokenizer: str | None = None  # defaults to the model dir
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int | None = None  # None: sized for the device (`batch_limits`)
    max_num_batched_tokens: int | None = None  # None: sized for the device (`batch_limits`)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None  # overrides the memory-derived KV budget
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "auto": per layer, the fastest backend that serves the device, preferring CUDA-graph capture (triton on CUDA,
    # the torch references on CPU; attention_zoo.registry.auto_backend); a name forces that backend.
    attention_backend: str = "auto"  # for standard attention layers
    mla_backend: str = "auto"  # for MLA layers (DeepSeek-V2/V3)
    mamba_backend: str = "auto"  # for Mamba2 mixer layers
    trust_remote_code: bool = False
    speculative_config: dict[str, Any] | None = None
    eplb_config: dict[str, Any] | None = None  # MoE expert placement (conf/eplb); ignored by dense models
    # Replay decode, spec-verify and drafting steps from CUDA graphs where the device (CUDA) and every
    # attention backend allow it; elsewhere steps run eagerly (a warning names why, on CUDA).
    cuda_graphs: bool = True
    cuda_graph_sizes: list[int] | None = None  # padded batch sizes to capture; None: 1, 2, 4, 8, 16, ... max_num_seqs
    # Prompt lengths of batch-1 prefill graphs (one request's prompt or chunk, padded to the next size; with the
    # backends that allow multi-token graphs). None: 16, 32, 64, ... 512 up to max_num_batched_tokens; []: none.
    prefill_graph_sizes: list[int] | None = None
    # Triton kernels for RMSNorm(+residual), rotary and SiLU*mul on CUDA (research_lm.ops); off: the torch path.
    fused_ops: bool = True
    # Steps of up to this many tokens run Llama-family layers' projections as skinny GEMV kernels with the RMSNorm,
    # SwiGLU and residual add fused in (research_lm/ops/skinny_linear.py; CUDA, fused_ops on, whole weights, not
    # batch-invariant). Default 1, batch-1 decode: ahead of cuBLAS there on an H200
    # (experiments/results/bench_decode.md); at 4 rows its kernel reads each weight once per row and loses to it.
    # Above 1 (at most 4) all of a step's rows share one program, the weights read once, at every M. 0: off.
    skinny_rows: int = 1
    # On CUDA every kernel on the model path reduces each token's row in an order that depends neither on the
    # other rows of the step, nor on the query tokens per request, nor on how a context was split into steps:
    # greedy tokens and logprobs are then the same alone, in a batch, chunked, preempted or speculated
    # (research_lm/ops/batch_invariant.py). Also on with env VLLM_BATCH_INVARIANT=1. On CPU it changes nothing.
    batch_invariant: bool = False
    # The model forward through torch.compile (inductor, dynamic shapes; attention stays eager; composes with
    # cuda_graphs). See research_lm/worker/compilation.py.
    compile: bool = False
    # Schedule and launch step N + 1 before collecting step N's tokens, so the host work of a step overlaps
    # the device's (research_lm/engine/scheduler.py). None: on for CUDA without a proposer or expert parallelism
    # (speculative steps need their tokens on the host to draft); True elsewhere works too (CPU: no gain).
    async_scheduling: bool | None = None
    # A prompt arriving while other requests decode runs alone in a step of its own (they wait one step) instead
    # of joining theirs, where it fits a prefill graph: a step mixing both runs eagerly, tens of ms at a small
    # batch against ~1 ms per replay (research_lm/engine/scheduler.py). None: on wherever prefill graphs were captured;
    # True: also without graphs (any prompt within max_num_batched_tokens; to ablate the policy); False: off.
    separate_prefills: bool | None = None
    # torch's CPU threads, process-wide (torch.set_num_threads); None: torch's default. On CUDA a step's host tensors
    # are tiny, and OMP_NUM_THREADS=1 made batch-1 speculative steps steadier on an H100 (PERFORMANCE.md, sixteenth
    # pass); whether 1 should be the CUDA default is still to measure with this knob.
    host_threads: int | None = None
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights (speed runs, vLLM's name)
    # Ranks of tensor parallelism: one process per rank, started by torchrun (research_lm/engine/distributed.py)
    tensor_parallel_size: int = 1
    # Bound of every collective between ranks (tensor or expert parallelism): a rank that died or hangs ends the
    # others' runs with RankLostError after at most this long
    distributed_timeout_s: float = 300.0
    # Acceptance replay, never on by default: a profile's path or dict (research_lm/worker/acceptance_replay.py).
    # Every verify step runs for real, then each request keeps the number of drafts the profile replays: time is
    # real, acceptance is the profile's, the outputs mean nothing (each RequestOutput says so).
    acceptance_replay: str | dict[str, Any] | None = None
    # Under replay, row n's token repeats the request's token this many positions back (0: the target's argmax), so a
    # model-free drafter (ngram, suffix) keeps finding a periodic prompt's continuation; must exceed the drafts.
    acceptance_replay_echo: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # model-family knobs

    def model_extra(self) -> dict[str, Any]:
        """What model constructors read from `ModelBuildContext.extra`: per-kind backends and EPLB."""
        return {**self.extra, "mla_backend": self.mla_backend, "mamba_backend": self.mamba_backend,
                "eplb": self.eplb_config}

    def __post_init__(self) -> None:
        _check_types(self)
        self.batch_invariant = self.batch_invariant or os.environ.get(BATCH_INVARIANT_ENV, "0").strip() == "1"
        self._check_batch_invariant()
        if not 0 <= self.skinny_rows <= SKINNY_MAX_ROWS:
            raise ValueError(f"skinny_rows must be in [0, {SKINNY_MAX_ROWS}] (tokens per step), got {self.skinny_rows}")
        if self.speculative_config:  # a bad value is refused before the target's weights load
            from research_lm.worker.spec import check_speculative_config

            check_speculative_config(self.speculative_config)
        self._check_acceptance_replay()
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.cuda_graph_sizes is not None and not all(int(s) >= 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}")
        if self.prefill_graph_sizes is not None and not all(int(s) >= 1 for s in self.prefill_graph_sizes):
            raise ValueError(f"prefill_graph_sizes must be positive prompt lengths, got {self.prefill_graph_sizes}")
        if self.host_threads is not None and self.host_threads < 1:
            raise ValueError(f"host_threads must be >= 1 (or None), got {self.host_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is reserved), got {self.num_gpu_blocks}")

    def _check_acceptance_replay(self) -> None:
        """A replay needs drafts to replay; its profile is read and checked before any weights load."""
        if self.acceptance_replay_echo < 0:
            raise ValueError(f"acceptance_replay_echo must be >= 0, got {self.acceptance_replay_echo}")
        if self.acceptance_replay is None:
            if self.acceptance_replay_echo:
                raise ValueError("acceptance_replay_echo shapes replayed tokens: it needs an acceptance_replay")
            return
        if not self.speculative_config:
            raise ValueError("acceptance_replay replays how many drafts each verify step accepts: it needs a "
                             "speculative_config")
        from research_lm.worker.acceptance_replay import load_profile

        load_profile(self.acceptance_replay)

    def _check_batch_invariant(self) -> None:
        """What no model can make batch-invariant; the engine refuses backends and layers when it builds them."""
        if not self.batch_invariant:
            return
        if self.compile:
            raise ValueError("batch_invariant=True does not combine with compile=True: inductor picks its own "
                             "reduction splits from each shape; turn one off")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"batch_invariant=True does not combine with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: NCCL's all-reduce sums in an order set by the message "
                             "size and each row's place in it, hence by the batch; use 1")

    def for_device(self, device: torch.device) -> EngineConfig:
        """This config with the batch limits left None sized for `device`: vLLM's offline sizes on a GPU (what
        bench_throughput tunes to; the batch-1 graphs are the same), small ones on CPU."""
        seqs, tokens = _BATCH_LIMITS["cuda" if device.type == "cuda" else "cpu"]
        return replace(self, max_num_seqs=self.max_num_seqs or seqs,
                       max_num_batched_tokens=self.max_num_batched_tokens or tokens)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.bfloat16)


def _check_types(config: Any) -> None:
    """Each field's value against its annotation (int, float, bool, str, list, dict, optionally None), so a bad
    value fails here naming the field instead of deep inside a step. A bool is not an int; an int is a float."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if not matches_annotation(value, hints[f.name]):
            raise InvalidType(f"{f.name} must be {describe_annotation(hints[f.name])}, got {value!r}")
