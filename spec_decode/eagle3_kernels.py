"""Two Triton kernels around EAGLE-3's midlayer: its input, and its greedy pick.

Why: a draft graph's forwards are a one-layer head over a handful of rows, so on the GPU its time follows its kernel
count (~2 µs each on an H200). A profile of the batch-1 "verified" draft graph on the reference target (98 kernels,
197 µs; PERFORMANCE.md, twelfth pass) spent per head step ~2 µs on the embedding lookup, ~2.6 µs on the two input
norms, ~1.1 µs on their concatenation, ~3 µs on the argmax over the draft vocabulary and ~1.5 µs on its d2t lookup.

- `eagle3_input`: [norm_in(E[ids]); norm_hidden(features)] in one pass per row (the embedding row and the feature
  row stay in registers), where the torch path runs an embedding gather, two RMSNorms and a cat. The norms are
  `research_lm.ops.rms_norm`'s arithmetic, op for op, so the rows are bit-identical to that kernel's.
- `argmax_gather`: table[argmax(logits)] per row (the first maximum on ties, as torch), where the torch path runs an
  argmax reduction and an index_select.

`Eagle3Head` takes them where `research_lm.ops.use_fused` says so (CUDA, `runner.fused_ops` on); its torch code is
their reference, and tests/spec_decode/test_eagle3_kernels.py compares the two under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for, round_to


@triton.jit
def _normed(x, w_ptr, cols, mask, hidden, eps, dtype: tl.constexpr, out_dtype: tl.constexpr):
    """`_rms_norm_kernel`'s row without a residual: x fp32 (loaded from `dtype`) -> the stored values."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(round_to(x * rstd, dtype) * w, out_dtype)


@triton.jit(do_not_specialize_on_alignment=["ids_ptr"])
def _eagle3_input_kernel(
    ids_ptr,  # int64 [T]
    emb_ptr,  # [V, H], row stride emb_stride
    emb_stride,
    feat_ptr,  # [T, H], row stride feat_stride
    feat_stride,
    w_in_ptr,  # [H] input_layernorm
    w_hidden_ptr,  # [H] hidden_norm
    out_ptr,  # [T, 2H] contiguous
    hidden,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = emb_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    token = tl.load(ids_ptr + row)
    e = tl.load(emb_ptr + token * emb_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * 2 * hidden + cols, _normed(e, w_in_ptr, cols, mask, hidden, eps, dtype, out_dtype),
             mask=mask)
    f = tl.load(feat_ptr + row * feat_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * 2 * hidden + hidden + cols,
             _normed(f, w_hidden_ptr, cols, mask, hidden, eps, dtype, out_dtype), mask=mask)


def eagle3_input(
    ids: torch.Tensor,  # [T] int64
    embedding: torch.Tensor,  # [V, H]
    features: torch.Tensor,  # [T, H], embedding's dtype, last dim contiguous
    input_norm: torch.Tensor,  # [H]
    hidden_norm: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, 2H]: [input_norm(embedding[ids]); hidden_norm(features)]
    """EAGLE-3's midlayer input in one kernel (module docstring); a new contiguous tensor."""
    t, hidden = ids.shape[0], embedding.shape[1]
    assert ids.dtype == torch.int64 and ids.dim() == 1 and embedding.stride(1) == 1, (ids.dtype, embedding.stride())
    assert features.shape == (t, hidden) and features.dtype == embedding.dtype and features.stride(1) == 1
    assert input_norm.shape == hidden_norm.shape == (hidden,)
    assert input_norm.is_contiguous() and hidden_norm.is_contiguous()
    out_dtype = torch.promote_types(embedding.dtype, input_norm.dtype)
    assert out_dtype == torch.promote_types(embedding.dtype, hidden_norm.dtype)
    out = torch.empty(t, 2 * hidden, dtype=out_dtype, device=embedding.device)
    if t:
        block = next_power_of_2(hidden)
        _eagle3_input_kernel[(t,)](
            ids, embedding, embedding.stride(0), features, features.stride(0), input_norm, hidden_norm, out,
            hidden, eps, BLOCK=block, num_warps=num_warps_for(block),
        )
    return out


@triton.jit(do_not_specialize_on_alignment=["out_ptr"])
def _argmax_gather_kernel(
    logits_ptr,  # [n, V], row stride logits_stride
    logits_stride,
    table_ptr,  # int64 [V]
    out_ptr,  # int64 [n]
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = start + tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
        better = m > best  # strictly: an equal maximum in a later block is not the first
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row, tl.load(table_ptr + best_i))


def argmax_gather(
    logits: torch.Tensor,  # [n, V], last dim contiguous, no NaN
    table: torch.Tensor,  # int64 [V]
    out: torch.Tensor | None = None,  # int64 [n]
) -> torch.Tensor:
    """table[logits.argmax(-1)] in one kernel (module docstring), into `out` if given."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and table.dtype == torch.int64 and table.shape == (vocab,) and table.is_contiguous()
    out = torch.empty(n, dtype=torch.int64, device=logits.device) if out is None else out
    assert out.shape == (n,) and out.dtype == torch.int64 and out.is_contiguous()
    if n:
        block = min(next_power_of_2(vocab), 4096)
        _argmax_gather_kernel[(n,)](logits, logits.stride(0), table, out, vocab, BLOCK=block,
                                    num_warps=num_warps_for(block))
    return out
