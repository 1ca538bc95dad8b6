"""Placement primitives shared by the policies: replication by load, balanced packing, map inversion.

They work on numpy arrays holding a batch of independent rows (layers, or layer x node pairs): the
loops run over items, never over rows, and keep rows in the last axis so every step is one small
vectorised op. (numpy, not torch: at these sizes the per-op overhead dominates and numpy's is ~2x
lower.) Ties are broken deterministically: stable sorts (the lower index first among equal loads)
and first-index argmin / argmax (the lower pack or expert index first).
"""

from __future__ import annotations

import numpy as np
import torch

# Added to a full pack's key so that argmin never picks it again; loads are far below this.
_FULL = 1e300


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a permutation: out[r, perm[r, i]] = i.  perm: [rows, n] int64."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def replicate_by_load(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gives `num_phy - num_log` extra replicas, one at a time, to the expert with the highest load per
    replica (weight / count); ties go to the lower expert index. This greedy is D'Hondt apportionment:
    it minimises the largest per-replica load.

    weight: [rows, num_log] float64. Returns
      phy2log [rows, num_phy]: slots 0..num_log-1 hold experts 0..num_log-1, then the extra replicas
                               in the order they were granted;
      phyrank [rows, num_phy]: replica index of each slot (0 for the original);
      logcnt  [rows, num_log]: replicas per expert.
    """
    rows, num_log = weight.shape
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log)
    phyrank = np.zeros((rows, num_phy), dtype=np.int64)
    w_t = np.ascontiguousarray(weight.T)  # [num_log, rows]
    cnt_t = np.ones((num_log, rows), dtype=np.int64)
    per_replica = w_t.copy()
    flat_cnt, flat_per_replica, flat_w = cnt_t.reshape(-1), per_replica.reshape(-1), w_t.reshape(-1)
    row = np.arange(rows)
    for slot in range(num_log, num_phy):
        expert = per_replica.argmax(axis=0)  # first maximal index
        f = expert * rows + row
        c = flat_cnt[f]
        phy2log[:, slot] = expert
        phyrank[:, slot] = c
        c += 1
        flat_cnt[f] = c
        flat_per_replica[f] = flat_w[f] / c
    return phy2log, phyrank, np.ascontiguousarray(cnt_t.T)


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs n items into `num_packs` packs of exactly n / num_packs items each, greedily: items in
    descending load order (stable sort: the lower index first among equal loads) each go to the
    lightest pack that still has room (the lower pack index among equally light ones).

    weight: [rows, n] float64, n divisible by num_packs. Returns
      pack_index   [rows, n]: pack of each item;
      rank_in_pack [rows, n]: position of the item inside its pack (order of arrival).
    With one item per pack, item i goes to pack i (as in deepseek-ai/EPLB).
    """
    rows, n = weight.shape
    assert n % num_packs == 0, (n, num_packs)
    capacity = n // num_packs
    if capacity == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    sorted_t = np.ascontiguousarray(np.take_along_axis(weight, order, axis=1).T)  # [n, rows]
    key = np.zeros(num_packs * rows)  # pack load, + _FULL once the pack is full; [num_packs, rows]
    count = np.zeros(num_packs * rows, dtype=np.int64)
    key_2d = key.reshape(num_packs, rows)
    pack_sorted = np.empty((n, rows), dtype=np.int64)
    rank_sorted = np.empty((n, rows), dtype=np.int64)
    row = np.arange(rows)
    for j in range(n):
        pack = key_2d.argmin(axis=0)  # first minimal index
        pack_sorted[j] = pack
        f = pack * rows + row
        c = count[f]
        rank_sorted[j] = c
        c += 1
        count[f] = c
        key[f] += sorted_t[j] + _FULL * (c == capacity)
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    np.put_along_axis(pack_index, order, pack_sorted.T, axis=1)
    np.put_along_axis(rank_in_pack, order, rank_sorted.T, axis=1)
    return pack_index, rank_in_pack


def replica_rank(phy2log: np.ndarray) -> np.ndarray:
    """Replica index of each slot, numbering the slots of each logical expert in slot order.
    phy2log: [layers, num_phy] -> [layers, num_phy] int64."""
    num_phy = phy2log.shape[1]
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(phy2log, order, axis=1)
    pos = np.broadcast_to(np.arange(num_phy), sorted_ids.shape)
    starts = np.ones(sorted_ids.shape, dtype=bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run_start = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, pos - run_start, axis=1)
    return rank


def replica_counts(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """logcnt [layers, num_logical]: how many slots of phy2log [layers, num_phy] hold each expert."""
    layers = phy2log.shape[0]
    flat_ids = (phy2log + (np.arange(layers) * num_logical)[:, None]).reshape(-1)
    return np.bincount(flat_ids, minlength=layers * num_logical).reshape(layers, num_logical)


def finish_placement(
    phy2log: np.ndarray, num_logical: int, phyrank: np.ndarray | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log, log2phy, logcnt) as int64 torch tensors, from phy2log [layers, num_phy] and the
    replica index of each slot (by default, replicas are numbered in slot order).
    log2phy[l, e, r] is the slot of replica r of expert e, -1 for r >= logcnt[l, e]; its last dim is
    the largest replica count over all layers."""
    layers, num_phy = phy2log.shape
    if phyrank is None:
        phyrank = replica_rank(phy2log)
    logcnt = replica_counts(phy2log, num_logical)
    max_cnt = int(logcnt.max())
    log2phy = np.full((layers, num_logical * max_cnt), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * max_cnt + phyrank,
                      np.broadcast_to(np.arange(num_phy), (layers, num_phy)), axis=1)
    return (torch.from_numpy(np.ascontiguousarray(phy2log)),
            torch.from_numpy(log2phy.reshape(layers, num_logical, max_cnt)),
            torch.from_numpy(logcnt))
