"""The runner's view of speculative decoding: a proposer protocol and the registry of proposers.

A plugin package fills `PROPOSERS` (`@register_proposer("name")` on a factory); it is found through the
"research_lm.proposers" entry-point group, so this package never names it.

The runner knows nothing about ngram tables or EAGLE heads; it hands each step's outcome to the
proposer (`Proposer`, built by its factory from a `DraftTarget`) and verifies what comes back next step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attention_zoo import CommonAttentionMetadata
from attention_zoo.registries import Registry
from research_lm.api.checks import checked
from research_lm.engine.request import Request
from research_lm.worker.rng import to_device
from research_lm.worker.token_tree import TreeShape


@dataclass
class StepOutcome:
    """What the target produced this step, for the proposer to draft from. At launch (`Proposer.propose_on_device`)
    the emitted tokens exist only on the device; at collect (`Proposer.propose`) the host has them too."""

    requests: list[Request]  # scheduled requests in batch order
    input_ids: torch.Tensor  # [num_tokens] the flat batch fed to the target
    positions: torch.Tensor  # [num_tokens]
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    hidden_states: torch.Tensor | None  # [num_tokens, hidden] the target's final hidden states
    aux_hidden_states: list[torch.Tensor] | None  # per aux layer, [num_tokens, hidden]
    # The step's batch: block tables (shared with a drafter's own KV), seq lens, slots, each request's table row.
    common: CommonAttentionMetadata
    tokens: TokenTable  # every request's tokens on the device, this step's emitted ones appended
    emitted_ids: torch.Tensor  # [num_reqs, m] int64 on the device: request i's emitted tokens first, -1 after
    num_emitted: torch.Tensor  # [num_reqs] int32 on the device: how many (0: a prompt chunk short of its end)
    greedy_ids: torch.Tensor | None = None  # [num_tokens] the target's argmax per row, on the device, when a
    # graph computed it: what EAGLE's "verified" draft graph drafts from
    emitted: list[list[int]] | None = None  # at collect: the emitted tokens on the host (not yet appended to the
    # requests); None at launch
    num_rejected: list[int] | None = None  # at collect: drafts rejected per request (their KV slots are stale)


@dataclass(frozen=True)
class TokenTable:
    """The runner's token table (research_lm/worker/request_state.py): row r holds a request's prompt and outputs,
    `num_tokens[r]` of them; the drafts of its next step go right after them."""

    token_ids: torch.Tensor  # [R, W] int32
    num_tokens: torch.Tensor  # [R] int32
    rows: torch.Tensor  # [num_reqs] int32: the step's requests' rows (common.request_rows)
    num_drafts: torch.Tensor | None = None  # [R] int32: real drafts held after the tokens (where `Drafts.in_table`)
    stop_at: torch.Tensor | None = None  # [R] int64: the token count at which max_tokens ends the request


@dataclass
class Drafts:
    """A proposer's drafts for the next step: the runner writes them into its device token table right after each
    request's tokens, so the next step reads them on the device and the host never needs their values."""

    index: list[int]  # the step's requests (batch index) that drafted
    token_ids: torch.Tensor  # [len(index), k] int64 on the device; a request's slots past its count: anything
    num: list[int] | torch.Tensor | None = None  # real drafts per drafted request (host list, or int [len(index)] on
    # the device: an n-gram lookup on the device knows its matches only there); None: all k
    probs: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [k_i, vocab] q, where sampled
    tree_parents: torch.Tensor | None = None  # [len(index), N + 1] int64: each request's own token tree (a dynamic
    # one, token_tree.DynamicTree), node j's parent (column 0: -1); None: the proposer's static tree, or a chain
    in_table: bool = False  # the proposer wrote them (and `num`) into `TokenTable` itself, in order: every request
    # of the step drafted (a graph that writes them where it drafts them)

    def capped(self, cap: int | None) -> Drafts:
        """At most `cap` real drafts per request (the speculation policy's arm): a chain's first drafts, a tree's
        first nodes (breadth-first: a subtree). Drafts written into the table by the proposer (`in_table`) are
        capped there by the runner."""
        if cap is None or cap >= self.token_ids.shape[1] or self.in_table:
            return self
        num = self.num if self.num is not None else [self.token_ids.shape[1]] * len(self.index)
        return replace(self, num=num.clamp(max=cap) if isinstance(num, torch.Tensor) else [min(n, cap) for n in num])

    @classmethod
    def from_lists(cls, index: list[int], token_ids: list[list[int]], k: int, device: torch.device,
                   probs: dict[str, torch.Tensor] | None = None) -> Drafts:
        """Drafts the host computed (`index[i]` drafted `token_ids[i]`, up to k each), padded to k in one copy."""
        padded = np.zeros((len(index), k), dtype=np.int64)
        for i, ids in enumerate(token_ids):
            padded[i, : len(ids)] = ids
        return cls(index, to_device(torch.from_numpy(padded), torch.int64, device), [len(t) for t in token_ids],
                   probs or {})


@dataclass(frozen=True)
class DraftTarget:
    """What a proposer's factory may know of the target it drafts for (no engine: these fields are the API)."""

    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_model_len: int
    attention_backend: str  # for the drafter's own attention layers ("auto": chosen per layer, as the target's)
    model_extra: dict[str, Any]  # what the target's layers were built with besides (MLA / Mamba backends, knobs)
    trust_remote_code: bool  # for a draft model's checkpoint, as for the target's
    embed_tokens: nn.Module  # the target's input embedding, [vocab, hidden]
    compute_logits: Callable[[torch.Tensor], torch.Tensor]  # the target's LM head: [n, hidden] -> [n, vocab] fp32
    model_path: Path | None = None  # the target's checkpoint directory (an MTP head reads its extra layers there)


class Proposer(ABC):
    """A speculative proposer: each step the runner hands it the step's outcome, writes the drafts it returns into the
    device token table, and the next step verifies them.

    Two entry points, one protocol. `propose_on_device` runs right behind the target's verification, at launch,
    from device values alone; where it returns drafts, the engine may launch the next step before this one's tokens
    reach the host (async scheduling), whatever the proposer. Otherwise the runner calls `propose` at collect, with
    the emitted tokens on the host, and the next step waits for it.

    Attributes a proposer sets (the defaults here are a proposer without them):
    - `num_speculative_tokens`: drafts per request and step, k;
    - `aux_hidden_state_layers`: target layers whose input residual streams it reads (EAGLE-3); () for none;
    - `num_lookahead_tokens`: KV slots its drafter writes past the verified tokens;
    - `needs_last_hit_block_recomputed`: its cached rows depend on the token after them (EAGLE);
    - `cache_layers`: its drafter's `CacheLayer`s, allocated with the target's and sharing its block tables;
    - `token_tree`: the tree its drafts fill (research_lm/worker/token_tree.py): a static `TokenTree`, a
      `DynamicTree` (each request's shape comes with its drafts, `Drafts.tree_parents`), or None for a chain. Then
      `num_speculative_tokens` is its node count N: draft j of a request is node j + 1, and the runner verifies the
      nodes as a tree.
    """

    num_speculative_tokens: int
    aux_hidden_state_layers: tuple[int, ...] = ()
    num_lookahead_tokens: int = 0
    needs_last_hit_block_recomputed: bool = False
    cache_layers: Sequence[nn.Module] = ()
    token_tree: TreeShape | None = None

    def propose_on_device(self, outcome: StepOutcome) -> Drafts | None:
        """At launch, behind the verification: the drafts of the step's requests from device values alone
        (`outcome.emitted` is None), without waiting for the device; None where this proposer cannot (then `propose`
        runs at collect)."""
        return None

    @abstractmethod
    def propose(self, outcome: StepOutcome) -> Drafts:
        """At collect: the drafts of the step's requests, from the outcome with its emitted tokens on the host."""

    def on_requests_removed(self, req_ids: set[str]) -> None:
        """Finished or preempted: drop any per-request drafter state."""
        return None

    def drafters(self) -> list[nn.Module]:
        """The modules it runs (runner.fused_ops reaches their layers too)."""
        return [v for v in vars(self).values() if isinstance(v, nn.Module)]

    def capture_cuda_graphs(self, **capture: Any) -> None:
        """Capture the drafter's graphs beside the target's (`ModelRunner.capture_cuda_graphs` passes the sizes)."""
        return None


# method name -> factory: (speculative_config: dict, target: DraftTarget) -> Proposer. Plugins add their methods
# through the "research_lm.proposers" entry-point group (each entry a module that registers names, or maps them to
# the modules that do with `PROPOSERS.add_module`); an unknown method's error lists them all.
PROPOSERS: Registry[Callable[[dict[str, Any], DraftTarget], Proposer]] = Registry(
    "speculative method", plugins="research_lm.proposers")


def speculative_method(speculative_config: dict[str, Any]) -> str | None:
    """The config's "method"; without one, inferred from its "model" as vLLM does: "ngram" (or "[ngram]") names
    itself; a head whose config.json lists an EAGLE-3 architecture, or whose name says EAGLE-3, is eagle3; one
    with Medusa's `medusa_num_heads` is medusa; a name that says EAGLE is eagle (EAGLE-1 heads declare a plain
    Llama architecture); any other model is a draft_model."""
    method, model = speculative_config.get("method"), speculative_config.get("model")
    if method is not None or model is None:
        return method
    if str(model) in ("ngram", "[ngram]"):
        return "ngram"
    from research_lm.models.loader import read_json_config, resolve_model_path

    try:
        config = read_json_config(resolve_model_path(str(model)))
    except ValueError:  # missing or unreadable: the draft_model loader names the problem
        config = {}
    architectures = " ".join(config.get("architectures") or []).lower()
    name = Path(str(model)).name.lower()
    if "eagle3" in architectures or "eagle3" in name:
        return "eagle3"
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return "medusa"
    if "eagle" in architectures or "eagle" in name:
        return "eagle"
    return "draft_model"


# speculative_config keys every method reads (vLLM's names) -> the kind of its value (api/checks.py); None
# leaves a key unset (conf/spec's yaml writes nulls). A method's own keys come with its registration.
_COMMON_KEYS = {"method": "str?", "model": "path?", "num_speculative_tokens": "posint?",
                "draft_tensor_parallel_size": "posint?", "disable_by_batch_size": "posint?",
                "speculation_policy": "str?"}
_METHOD_KEYS: dict[str, dict[str, str]] = {}  # method -> its own keys -> their kinds (register_proposer)


def register_proposer(name: str, **keys: str) -> Callable[[Callable], Callable]:
    """`@register_proposer("ngram", prompt_lookup_min="posint?", ...)` on the factory of method `name`, with the
    speculative_config keys it reads beyond the common ones, each with its value's kind (api/checks.py)."""
    def wrap(factory: Callable) -> Callable:
        _METHOD_KEYS[name] = dict(keys)
        return PROPOSERS.register(name)(factory)

    return wrap


def check_speculative_config(speculative_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with every value checked (numpy ints become ints) and its method resolved
    (`speculative_method`); errors name the key. Cheap (the method's module is imported, at most a head's
    config.json read), so the engine's config calls it before loading any weights."""
    if not isinstance(speculative_config, Mapping):
        raise ValueError(f"speculative_config must be a dict of vLLM's keys, got {speculative_config!r}")
    config = {k: checked(f"speculative_config[{k!r}]", v, _COMMON_KEYS[k]) if k in _COMMON_KEYS else v
              for k, v in speculative_config.items()}
    method = speculative_method(config)
    config["method"] = method
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {PROPOSERS.names()}")
    PROPOSERS.get(method)  # imports its module, which registers its keys
    kinds = _COMMON_KEYS | _METHOD_KEYS.get(method, {})
    unknown = sorted(set(config) - set(kinds))
    if unknown:  # a misspelt knob must not fall back to its default unnoticed
        raise ValueError(f"unknown speculative_config key(s) {unknown} for {method!r}; valid ones: {sorted(kinds)}")
    config = {k: checked(f"speculative_config[{k!r}]", v, kinds[k]) for k, v in config.items()}
    from research_lm.engine.spec_policy import POLICIES

    if config.get("speculation_policy") not in (None, *POLICIES):
        raise ValueError(f"unknown speculation_policy {config['speculation_policy']!r}; "
                         f"choose one of {sorted(POLICIES)}")
    if config.get("draft_tensor_parallel_size", 1) not in (1, None):
        raise ValueError(f"draft_tensor_parallel_size={config['draft_tensor_parallel_size']}: the drafter "
                         "runs on the target's one GPU (tensor parallelism is not implemented)")
    return config


def build_proposer(speculative_config: Mapping[str, Any], target: DraftTarget) -> Proposer:
    speculative_config = check_speculative_config(speculative_config)
    # a method whose module fails to import (a missing optional dependency) raises "... is not installed: <why>"
    return PROPOSERS.get(speculative_config["method"])(speculative_config, target)
