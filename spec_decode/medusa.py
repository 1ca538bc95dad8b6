"""Medusa heads in the published `FasterDecoding/medusa-*` layout, and their top-1 chain proposer.

Layout (FasterDecoding/Medusa `medusa/model/medusa_model.py`): `medusa_lm_head.pt` (a pickled state
dict; newer releases `medusa_lm_head.safetensors`, names sometimes prefixed `medusa_head.`) holding,
for head h and ResBlock l < medusa_num_layers,

    {h}.{l}.linear.weight [H, H], {h}.{l}.linear.bias [H]      ResBlock: x + SiLU(linear(x))
    {h}.{medusa_num_layers}.weight [vocab, H]                   the head's own lm_head, no bias

and config.json with `medusa_num_heads`, `medusa_num_layers`. Head h reads the target's final
(normed) hidden state at the last verified position n-1 (whose lm_head gave x[n]) and predicts
x[n+1+h]; so k drafts need k heads. No KV cache, no per-request state.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from research_lm.models.base import CheckpointError, ModelBuildContext, build_scope, load_params
from research_lm.models.layers import Linear
from research_lm.models.loader import checkpoint_files, read_json_config
from research_lm.worker.rng import to_device
from research_lm.worker.sampler import plain_greedy
from research_lm.worker.spec import Drafts, DraftTarget, Proposer, StepOutcome, register_proposer
from research_lm.worker.token_tree import TokenTree
from spec_decode.heads import (
    check_names,
    check_shape,
    device_budgets,
    expected_checkpoint_names,
    head_dir,
    read_tensors,
    start_drafting,
)

_WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_PREFIX = "medusa_head."


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int, bias: bool):
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """heads[h] = [ResBlock] * num_layers + [lm_head]; parameter names are the checkpoint's."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, bias: bool):
        super().__init__(
            nn.ModuleList([*(ResBlock(hidden_size, bias) for _ in range(num_layers)),
                           Linear(hidden_size, vocab_size, bias=False)])
            for _ in range(num_heads)
        )
        self._stacked: tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor] | None = None

    def stack(self) -> None:
        """Lay each layer's weights of all heads side by side in one tensor ([heads, ...]; the parameters become views
        of it, so no memory is added): `forward` then runs every head at once, one batched matmul per layer,
        instead of ~5 small kernels per head (a batch-1 step's drafting was ~0.5 ms of host launches)."""
        num_layers = len(self[0]) - 1
        blocks = [[head[layer] for head in self] for layer in range(num_layers)]
        weights = [torch.stack([b.linear.weight for b in layer]) for layer in blocks]
        biases = [torch.stack([b.linear.bias for b in layer]) if layer[0].linear.bias is not None else None
                  for layer in blocks]
        lm_head = torch.stack([head[-1].weight for head in self])
        for layer, w, b in zip(blocks, weights, biases, strict=True):
            for h, block in enumerate(layer):
                block.linear.weight.data = w[h]
                if b is not None:
                    block.linear.bias.data = b[h]
        for h, head in enumerate(self):
            head[-1].weight.data = lm_head[h]
        self._stacked = (weights, biases, lm_head)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[n, H] -> [n, num_heads, vocab] fp32: the first num_heads heads (default: all)."""
        if self._stacked is not None:
            return self._forward_stacked(hidden, num_heads or len(self))
        out = []
        for head in list(self)[:num_heads]:
            x = hidden
            for block in head[:-1]:
                x = block(x)
            out.append(F.linear(x, head[-1].weight).float())
        return torch.stack(out, dim=1)

    def _forward_stacked(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        weights, biases, lm_head = self._stacked
        x = hidden.unsqueeze(0).expand(k, *hidden.shape)  # [k, n, H]: every head reads the same row
        for w, b in zip(weights, biases, strict=True):  # ResBlock: x + SiLU(x W^T + b)
            wt = w[:k].transpose(1, 2)
            x = x + F.silu(torch.bmm(x, wt) if b is None else torch.baddbmm(b[:k, None], x, wt))
        return torch.bmm(x, lm_head[:k].transpose(1, 2)).transpose(0, 1).float()  # [n, k, V]


class MedusaProposer(Proposer):
    """The `Proposer` of Medusa heads: draft j of a request is head j's choice at its last verified row. Greedy drafts
    are picked on the device at launch (`propose_on_device`), so async scheduling launches the next step behind them;
    a request that samples its drafts or reads a penalty drafts at collect."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, heads: MedusaHeads, *, num_speculative_tokens: int, vocab_size: int, max_model_len: int,
                 token_tree: TokenTree | None = None):
        depth = token_tree.depth if token_tree is not None else num_speculative_tokens
        if not 1 <= depth <= len(heads):
            raise ValueError(f"{'the token tree depth' if token_tree else 'num_speculative_tokens'} must be in "
                             f"[1, medusa_num_heads = {len(heads)}] for Medusa, got {depth}")
        self.heads = heads
        heads.stack()
        self.depth = depth
        self.num_speculative_tokens = token_tree.num_drafts if token_tree is not None else depth
        self.token_tree = token_tree
        # a tree's node j holds the rank-r token of head depth(j) - 1 (Medusa's trees): those tables on the device,
        # and the real nodes under each chain budget b (depth <= b)
        self._nodes = None
        if token_tree is not None:
            device = heads[0][-1].weight.device
            self._nodes = tuple(torch.tensor(t, dtype=torch.int64, device=device)
                                for t in (token_tree.depths[1:], token_tree.ranks[1:], token_tree.real_nodes))
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def propose_on_device(self, outcome: StepOutcome) -> Drafts | None:
        """Every request plain greedy (or a token tree, whose drafts are every request's heads' top tokens): each
        draft is a raw top token of its head at the row that predicted the request's last emitted token, which the
        device knows: qsl[i + 1] - d_i - 2 + num_emitted[i] (d_i drafts verified; after a tree's verification the
        runner has moved the accepted path's rows where a chain's would be)."""
        reqs = outcome.requests
        if self.token_tree is None and not all(plain_greedy(r) for r in reqs):
            return None
        qsl = outcome.query_start_loc_cpu.numpy()
        drafts = np.fromiter((r.num_spec_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        device = outcome.hidden_states.device
        base = to_device(torch.from_numpy(qsl[1:] - drafts - 2), torch.int64, device)
        rows = (base + outcome.num_emitted).clamp_(min=0)  # a request that emitted nothing drafts nothing (budget 0)
        logits = self.heads(outcome.hidden_states[rows], self.depth)[:, :, : self.vocab_size]  # [n, depth, V]
        budgets = device_budgets(outcome, self.depth, self.max_model_len)
        if self._nodes is None:
            return Drafts(list(range(len(reqs))), logits.argmax(dim=-1), budgets)
        depths, ranks, real_nodes = self._nodes
        top = logits.topk(max(self.token_tree.ranks) + 1, dim=-1).indices  # [n, depth, ranks]
        tokens = top[:, depths - 1, ranks]  # [n, N]
        return Drafts(list(range(len(reqs))), tokens, real_nodes[budgets.long().clamp(0, self.depth)].to(torch.int32))

    def propose(self, outcome: StepOutcome) -> Drafts:
        if self.token_tree is not None:  # a tree's drafts are top tokens, whatever the request samples
            return self.propose_on_device(outcome)
        reqs = outcome.requests
        drafting = start_drafting(reqs, outcome.emitted, self.num_speculative_tokens, self.max_model_len)
        if not drafting.index:
            return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
        qsl = outcome.query_start_loc_cpu.tolist()
        computed = outcome.common.num_computed_tokens_cpu.tolist()
        # Row of position n-1 in the step's batch: the target computed c .. n-1 (+ rejected drafts).
        rows = [
            qsl[i] + (reqs[i].num_known_tokens + len(outcome.emitted[i]) - 1 - computed[i]) - 1 for i in drafting.index
        ]
        hidden = outcome.hidden_states[torch.tensor(rows, dtype=torch.int64, device=outcome.hidden_states.device)]
        logits = self.heads(hidden, self.num_speculative_tokens)  # [R, k, V]: heads past k would go unused
        rule = drafting.pick_rule(self.vocab_size)
        if rule == "sample":  # the heads do not read each other's drafts: all of them in one batch
            drafting.add_independent(logits, self.vocab_size)
            return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
        for j in range(self.num_speculative_tokens):  # a penalty reads the drafts before: one at a time
            active = drafting.active(j)
            if not active:
                break
            drafting.add(active, logits[active, j], self.vocab_size)
        return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)

    def on_requests_removed(self, req_ids: set[str]) -> None:
        pass  # stateless


def _weight_files(path: Path) -> list[Path]:
    for name in _WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    try:
        return checkpoint_files(path)
    except CheckpointError as e:
        raise CheckpointError(f"no Medusa weights in {path}: looked for {', '.join(_WEIGHT_FILES)} ({e})") from e


def _count(tensors: dict[str, torch.Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for n in tensors if (m := re.fullmatch(pattern, n))}
    return max(found) + 1 if found else 0


def load_medusa_heads(path: Path, *, hidden_size: int, vocab_size: int, build: ModelBuildContext) -> MedusaHeads:
    """Read and check a Medusa head directory against the target's hidden size and vocabulary."""
    what = f"Medusa head {path}"
    cfg = read_json_config(path)
    files = _weight_files(path)
    tensors = {n.removeprefix(_PREFIX): t for n, t in read_tensors(files).items()}
    num_heads = int(cfg.get("medusa_num_heads") or _count(tensors, r"(\d+)\.\d+\.(?:linear\.)?weight"))
    num_layers = int(cfg.get("medusa_num_layers") or _count(tensors, r"0\.(\d+)\.linear\.weight"))
    if num_heads < 1:
        raise CheckpointError(
            f"{what}: config.json has no medusa_num_heads and {files[0].name} holds no "
            "{head}.{layer}.linear.weight tensors: not a Medusa checkpoint"
        )
    head_name = f"0.{num_layers}.weight"
    if head_name not in tensors:
        raise CheckpointError(
            f"{what} lacks {head_name!r}, the first head's lm_head for medusa_num_layers = {num_layers}: "
            "not a Medusa checkpoint, or config.json disagrees with its tensors"
        )
    lm_head = tensors[head_name]
    if lm_head.dim() != 2:
        raise CheckpointError(f"{what}: {head_name} has shape {tuple(lm_head.shape)}, expected [vocab, hidden]")
    if lm_head.shape[1] != hidden_size:
        raise CheckpointError(
            f"{what} has hidden size {lm_head.shape[1]} ({head_name}), but the target's hidden size is {hidden_size}"
        )
    if lm_head.shape[0] != vocab_size:
        raise CheckpointError(
            f"{what} predicts over a vocabulary of {lm_head.shape[0]} tokens ({head_name}), but the target has "
            f"{vocab_size}"
        )
    for h in range(num_heads):
        check_shape(what, f"{h}.{num_layers}.weight", tensors.get(f"{h}.{num_layers}.weight", torch.empty(0)),
                    (vocab_size, hidden_size), "vocab x hidden size")
        for layer in range(num_layers):
            name = f"{h}.{layer}.linear.weight"
            check_shape(what, name, tensors.get(name, torch.empty(0)), (hidden_size, hidden_size), "hidden x hidden")
    with build_scope(build):
        heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size, bias="0.0.linear.bias" in tensors)
    check_names(what, tensors, expected_checkpoint_names(heads))
    with torch.no_grad():
        load_params(heads, tensors.items())
    heads.requires_grad_(False)
    return heads.eval()


@register_proposer("medusa", speculative_token_tree="tree?")
def build_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> MedusaProposer:
    path = head_dir(speculative_config, "medusa")
    k = speculative_config.get("num_speculative_tokens")
    tree = TokenTree.of_config(speculative_config)
    k = tree.depth if tree is not None else k
    if k is None:
        raise ValueError("speculative_config for 'medusa' needs num_speculative_tokens")
    build = ModelBuildContext(target.device, target.dtype, target.attention_backend)
    heads = load_medusa_heads(path, hidden_size=target.hidden_size, vocab_size=target.vocab_size, build=build)
    return MedusaProposer(heads, num_speculative_tokens=int(k), vocab_size=target.vocab_size,
                          max_model_len=target.max_model_len, token_tree=tree)
