"""The backend-neutral description of one step's ragged batch.

The runner builds one `CommonAttentionMetadata` per step; each backend's `build_metadata` turns it
into whatever its kernels want (FlashInfer plans, split-KV workspaces, Mamba chunk indices, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    # Request i owns query tokens query_start_loc[i] : query_start_loc[i + 1] of the flat batch.
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host mirror
    seq_lens: torch.Tensor  # [num_reqs] int32, device: context length after this step's tokens
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, host mirror
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32: tokens already in the cache/state
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device; 0 = null block
    slot_mapping: torch.Tensor  # [num_tokens] int64, device: flat KV slot of each token; -1 = skip
    # Persistent row of each request in the runner's state tables; Mamba uses it as the state slot.
    request_rows: torch.Tensor  # [num_reqs] int32, device
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Token-tree verify steps (speculative decoding): bit j of tree_bits[t] is set iff query token t may attend to
    # query token j of its own request (0 = the request's first query token); every query token still sees the whole
    # cached context. Ancestors precede their descendants, so the bits of t lie within 0..t and include t; q_len <= 63.
    # None = causal. A chain's bits (token i: bits 0..i) give exactly the causal result.
    tree_bits: torch.Tensor | None = None  # [num_tokens] int64, device

    @property
    def query_lens_cpu(self) -> torch.Tensor:  # [num_reqs] int32
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
