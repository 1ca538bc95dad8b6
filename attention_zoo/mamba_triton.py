"""The `mamba_triton` backend: Mamba2 mixers on our Triton kernels, same state layout as `mamba_torch_ref`.

Per layer and step: one varlen causal-conv launch over every request (+ one launch writing the conv
states back), then the chunked SSD scan over the requests with more than one token and the
single-step state update over the decodes — a mixed batch is served by both, each on its own
requests (`MambaMetadata.prefill_req_idx` / `decode_req_idx`, made once per step). Every launch
size comes from host integers of the metadata: forward never syncs.

CUDA graphs: decode graphs (q = 1, every request through the state update) and batch-1 prefill graphs (q > 1,
through the scan, which reads the request's length on the device) replay; the graph's metadata is fixed at
capture (`mamba.build_mamba_graph_metadata`) but for has_initial_state, which `prepare_replay` recomputes on the
device from the record's seq_lens and query_start_loc (no host lengths: `graphs_plan_on_host` stays off). Padding
requests (slot -1) touch no state. Mixed prefill + decode batches of several requests have no graph: they run
eagerly. The kernels and their launchers live in `attention_zoo/triton_kernels/mamba_{conv,ssd}.py`.
"""

from __future__ import annotations

import os

import torch

from attention_zoo.base import AttentionSpec, BackendCapabilities
from attention_zoo.mamba import (
    MambaBackend,
    MambaImpl,
    MambaMetadata,
    MambaSpec,
    build_mamba_graph_metadata,
    refresh_graph_has_initial_state,
)
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import register_backend
from attention_zoo.triton_kernels.mamba_conv import causal_conv1d_varlen
from attention_zoo.triton_kernels.mamba_ssd import selective_state_update, ssd_chunk_scan

# Under TRITON_INTERPRET=1 the kernels run (slowly) on CPU tensors; that is how CPU tests use them.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class MambaTritonImpl(MambaImpl):
    def forward(self, xbc, dt, weights, cache, metadata: MambaMetadata):
        spec: MambaSpec = self.spec
        conv_state, ssm_state = cache
        md = metadata
        num_rows = xbc.shape[0]
        conv_out = torch.empty(num_rows, spec.conv_dim, dtype=xbc.dtype, device=xbc.device)
        causal_conv1d_varlen(
            xbc, weights.conv_weight, weights.conv_bias, conv_state, conv_out,
            md.query_start_loc, md.state_slots, md.has_initial_state,
            num_reqs=md.num_reqs, max_query_len=md.max_query_len, interpret=_INTERPRET,
        )  # fmt: skip
        # NOTE: rows past the batch's tokens (graph padding) are left unwritten.
        y = torch.empty(num_rows, spec.intermediate_size, dtype=xbc.dtype, device=xbc.device)
        ssm_args = (conv_out, dt, weights.A_log, weights.D, weights.dt_bias, y, ssm_state,
                    md.query_start_loc, md.state_slots, md.has_initial_state)
        if md.num_prefills:
            ssd_chunk_scan(*ssm_args, md.prefill_req_idx, n_groups=spec.n_groups,
                           time_step_limit=spec.time_step_limit, interpret=_INTERPRET)
        if md.num_decodes:
            selective_state_update(*ssm_args, md.decode_req_idx, n_groups=spec.n_groups,
                                   time_step_limit=spec.time_step_limit)
        return y


@register_backend("mamba_triton")
class MambaTritonBackend(MambaBackend):
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"} if _INTERPRET else {"cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"mamba"}),
        cuda_graphs=True,
        cuda_graphs_multi_token=True,  # the scan's grid is per request; it reads each length on the device
    )

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> MambaMetadata:
        return build_mamba_graph_metadata(common)

    @classmethod
    def prepare_replay(cls, metadata: MambaMetadata, common: CommonAttentionMetadata) -> None:
        refresh_graph_has_initial_state(metadata)  # from the buffers the graph reads, which hold this step's rows

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> MambaImpl:
        assert isinstance(spec, MambaSpec), spec
        return MambaTritonImpl(spec)
