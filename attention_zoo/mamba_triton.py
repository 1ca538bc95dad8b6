"""The `mamba_triton` backend: Mamba2 mixers on our Triton kernels, same state layout as `mamba_torch_ref`.

Per layer and step: one varlen causal-conv launch over every request (+ one launch writing the conv
states back), then the chunked SSD scan over the requests with more than one token and the
single-step state update over the decodes — a mixed batch is served by both, each on its own
requests (`MambaMetadata.prefill_req_idx` / `decode_req_idx`, made once per step). Every launch
size comes from host integers of the metadata: forward never syncs.
The kernels and their launchers live in `attention_zoo/triton_kernels/mamba_{conv,ssd}.py`.
"""

from __future__ import annotations

import os

import torch

from attention_zoo.base import AttentionSpec, BackendCapabilities
from attention_zoo.mamba import MambaBackend, MambaImpl, MambaMetadata, MambaSpec
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
        cuda_graphs=False,  # not captured yet; nothing in forward stands in the way (no host syncs)
    )

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> MambaImpl:
        assert isinstance(spec, MambaSpec), spec
        return MambaTritonImpl(spec)
