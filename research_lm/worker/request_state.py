"""Per-request state in persistent device tables, indexed by a stable row (the design of vLLM's model runner V2).

A request's known tokens are written once, when it takes a row (admission, or again after a preemption, when the
host knows every token). From then on only the device writes the row: each step appends the tokens it emitted and
advances `num_computed` (`research_lm.ops.step_inputs.advance_rows`), and a proposer writes the drafts of the next
step right after the tokens. A step's inputs are gathered from here (`gather_step_inputs`), so the host stages only
counts (each request's row and query length) and never waits for a value still in flight: async scheduling, drafts
left on the device and deferred verification are the same mechanism, not three stand-ins.
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.engine.request import Request
from research_lm.ops import FUSED_DEVICE_TYPES
from research_lm.ops.reference import advance_rows_ref, write_drafts_ref
from research_lm.ops.step_inputs import RecurringLaunches
from research_lm.worker.rng import to_device
from research_lm.worker.spec import Drafts, TokenTable

NEVER = 1 << 40  # the stop_at of a request without max_tokens


def _stop_at(request: Request) -> int:
    """The token count at which max_tokens ends the request."""
    max_tokens = request.sampling_params.max_tokens
    return NEVER if max_tokens is None else request.num_prompt_tokens + max_tokens


class RequestRows:
    """Stable row per live request in the persistent state tables (tokens, block table, Mamba state slots)."""

    def __init__(self, max_num_reqs: int):
        self.free = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}

    def add(self, req_id: str) -> tuple[int, bool]:
        """The request's row, and whether it just took it."""
        row = self.row_of.get(req_id)
        if row is not None:
            return row, False
        row = self.row_of[req_id] = self.free.pop()
        return row, True

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free.append(row)


class RequestState:
    """The device tables of every live request, and the host's record of each row's prompt length."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_drafts: int, device: torch.device):
        # Columns: prompt + outputs (< max_model_len), then up to max_drafts drafts, then one spare that an append of
        # a verify step's k + 1 tokens at the very end may reach.
        self.width = max_model_len + max_drafts + 1
        self.device = device
        self.rows = RequestRows(max_num_reqs)
        self.token_ids = torch.zeros(max_num_reqs, self.width, dtype=torch.int32, device=device)  # [R, W]
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [R] prompt + outputs held
        self.num_computed = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [R] KV in the cache
        self.num_drafts = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [R] real drafts held
        self.stop_at = torch.full((max_num_reqs,), NEVER, dtype=torch.int64, device=device)  # [R] where max_tokens ends
        self.prompt_lens = np.zeros(max_num_reqs, dtype=np.int64)  # host: what penalties count as outputs
        self._new: list[tuple[int, Request]] = []
        self.launches = RecurringLaunches(max_graphs=32)  # the table kernels' launches, replayed where they recur

    def row(self, request: Request) -> int:
        """The request's row; a new row's known tokens are written by the next `flush`."""
        row, new = self.rows.add(request.request_id)
        if new:
            assert not request.num_output_placeholders, "a request takes a row only when the host knows its tokens"
            self.prompt_lens[row] = request.num_prompt_tokens
            self._new.append((row, request))
        return row

    def remove(self, req_ids: set[str]) -> None:
        self.rows.remove(req_ids)

    def clear(self) -> None:
        self.rows.remove(set(self.rows.row_of))
        self._new.clear()

    def flush(self) -> None:
        """Write the rows taken since the last flush: their known tokens, counts and computed prefix (one copy)."""
        if not self._new:
            return
        news, self._new = self._new, []
        lens = np.fromiter((r.num_known_tokens for _, r in news), dtype=np.int64, count=len(news))
        rows = np.fromiter((row for row, _ in news), dtype=np.int64, count=len(news))
        flat = np.concatenate([np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int64) for _, r in news])
        index = np.repeat(rows * self.width, lens) + (np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens))
        computed = np.fromiter((r.num_computed_tokens for _, r in news), dtype=np.int64, count=len(news))
        stop_at = np.fromiter((_stop_at(r) for _, r in news), dtype=np.int64, count=len(news))
        host = torch.from_numpy(np.concatenate([index, flat, rows, lens, computed, stop_at]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        up = host.to(self.device, non_blocking=True)
        t, n = len(flat), len(news)
        index_t, flat_t, rows_t, lens_t, computed_t, stop_at_t = up.split([t, t, n, n, n, n])
        self.token_ids.view(-1).index_copy_(0, index_t, flat_t.to(torch.int32))
        self.num_tokens.index_copy_(0, rows_t, lens_t.to(torch.int32))
        self.num_computed.index_copy_(0, rows_t, computed_t.to(torch.int32))
        self.num_drafts.index_fill_(0, rows_t, 0)
        self.stop_at.index_copy_(0, rows_t, stop_at_t)

    def table(self, rows: torch.Tensor) -> TokenTable:
        """The tables as a proposer sees them; rows [n]: the step's requests' rows."""
        return TokenTable(self.token_ids, self.num_tokens, rows, self.num_drafts, self.stop_at)

    def advance(self, rows: torch.Tensor, delta: torch.Tensor, emitted: torch.Tensor, num_emitted: torch.Tensor
                ) -> None:
        """Fold a step into the tables: request i (table row rows[i]) appends emitted[i, :num_emitted[i]] and
        `num_computed` gains delta[i] (its tokens less its draft slots) plus the drafts it accepted."""
        if self.device.type not in FUSED_DEVICE_TYPES:
            advance_rows_ref(self.token_ids, self.num_tokens, self.num_computed, rows, delta, emitted, num_emitted)
            return
        from research_lm.ops.step_inputs import advance_rows, launch_key

        def launch() -> None:
            advance_rows(self.token_ids, self.num_tokens, self.num_computed, rows, delta, emitted, num_emitted)

        if self.device.type != "cuda":  # (tests run the kernel on CPU under TRITON_INTERPRET)
            launch()
            return
        self.launches(("advance", *launch_key(rows, delta, emitted, num_emitted)), launch)

    def write_drafts(self, rows: torch.Tensor, drafts: Drafts, cap: int | None = None) -> list[int]:
        """Put the drafts right after their requests' tokens, with how many are real; rows [n]: each of the step's
        requests' row (the others keep no drafts). The draft slots of each drafted request's next step: a count the
        host knows (all k where only the device counts the real ones). `cap`: at most that many each (the caller
        capped `drafts` already; drafts the proposer wrote into the table are capped here)."""
        k = drafts.token_ids.shape[1] if cap is None else min(drafts.token_ids.shape[1], cap)
        if drafts.in_table:
            if k < drafts.token_ids.shape[1]:
                self.num_drafts[rows.long()] = self.num_drafts[rows.long()].clamp(max=k)
            return [k] * len(drafts.index)  # counted on the device
        every = drafts.index == list(range(len(rows)))  # (the common case: every request drafted, in order)
        if not every:
            self.num_drafts.index_fill_(0, rows.long(), 0)
        if not drafts.index:
            return []
        num = drafts.num if drafts.num is not None else [k] * len(drafts.index)  # (capped: <= k)
        if not every:
            rows = rows[to_device(drafts.index, torch.int64, self.device)]
        if self.device.type in FUSED_DEVICE_TYPES:
            from research_lm.ops.step_inputs import write_drafts
        else:
            write_drafts = write_drafts_ref
        write_drafts(self.token_ids, self.num_tokens, rows, drafts.token_ids.contiguous())
        real = num if isinstance(num, torch.Tensor) else to_device(num, torch.int32, self.device)
        self.num_drafts.index_copy_(0, rows.long(), real.to(torch.int32))
        return num if isinstance(num, list) else [k] * len(drafts.index)
