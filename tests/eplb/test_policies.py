"""EPLB policies: the deepseek-ai/EPLB README example, placement invariants for every policy, and
argument errors. Invariants: every logical expert has >= 1 replica, replica counts sum to the slots,
log2phy and phy2log describe the same placement, hierarchical deepseek keeps each group on one node."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from research_lm.eplb import available_policies, get_policy, rebalance_experts, simulate_ep

POLICIES = available_policies()

# deepseek-ai/EPLB README, "Interface and Example" (checked against the published README).
README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def test_readme_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    assert log2phy.shape == (2, 12, 2) and logcnt.shape == (2, 12)
    assert logcnt.dtype == phy2log.dtype == log2phy.dtype == torch.int64
    # replicas listed in creation order: the original slot first, then the redundant one
    assert log2phy[0, 5].tolist() == [0, 2] and log2phy[0, 0].tolist() == [12, -1]
    assert logcnt[0].tolist() == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]


def test_rebalance_experts_is_the_deepseek_policy():
    from research_lm.eplb import rebalance_experts as top_level
    assert get_policy("deepseek") is top_level


def check_placement(weight, out, num_replicas, num_gpus):
    phy2log, log2phy, logcnt = out
    num_layers, num_logical = weight.shape
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_logical)
    assert log2phy.shape == (num_layers, num_logical, int(logcnt.max()))
    assert phy2log.min() >= 0 and phy2log.max() < num_logical
    assert (logcnt >= 1).all(), "every logical expert needs a replica"
    assert (logcnt.sum(-1) == num_replicas).all()
    assert num_replicas % num_gpus == 0  # so every GPU holds num_replicas // num_gpus slots
    for layer in range(num_layers):
        counts = torch.bincount(phy2log[layer], minlength=num_logical)
        assert torch.equal(counts, logcnt[layer])
        slots = log2phy[layer]
        valid = torch.arange(slots.shape[1]) < logcnt[layer, :, None]
        assert (slots[~valid] == -1).all()
        assert sorted(slots[valid].tolist()) == list(range(num_replicas)), "each slot listed once"
        experts = torch.arange(num_logical)[:, None].expand_as(slots)
        assert torch.equal(phy2log[layer][slots[valid]], experts[valid]), "log2phy and phy2log disagree"


@st.composite
def configs(draw):
    """Valid (weight, num_replicas, num_groups, num_nodes, num_gpus), ties and zero loads included."""
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    num_gpus = num_nodes * draw(st.sampled_from([1, 2, 4]))
    num_groups = draw(st.sampled_from([1, 2, 3, 4, 8]))
    num_logical = num_groups * draw(st.integers(1, 4)) * num_nodes
    extra = draw(st.integers(0, num_logical))
    num_replicas = -(-(num_logical + extra) // num_gpus) * num_gpus
    num_layers = draw(st.integers(1, 3))
    high = draw(st.sampled_from([1, 5, 1000]))
    values = draw(st.lists(st.integers(0, high), min_size=num_layers * num_logical,
                           max_size=num_layers * num_logical))
    weight = torch.tensor(values, dtype=torch.int64).view(num_layers, num_logical)
    if draw(st.booleans()):
        weight = weight.double() * draw(st.floats(0.01, 100.0))
    return weight, num_replicas, num_groups, num_nodes, num_gpus


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_policy_invariants(name, cfg):
    weight, num_replicas, num_groups, num_nodes, num_gpus = cfg
    out = get_policy(name)(weight, num_replicas, num_groups, num_nodes, num_gpus)
    check_placement(weight, out, num_replicas, num_gpus)
    again = get_policy(name)(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert all(torch.equal(a, b) for a, b in zip(out, again)), "policies are deterministic"


@settings(max_examples=60, deadline=None)
@given(cfg=configs())
def test_deepseek_hierarchical_keeps_groups_on_one_node(cfg):
    weight, num_replicas, num_groups, num_nodes, num_gpus = cfg
    if num_groups % num_nodes != 0:
        return
    phy2log, _, _ = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    group_size = weight.shape[1] // num_groups
    node_of_slot = torch.arange(num_replicas) // (num_replicas // num_nodes)
    for layer in range(weight.shape[0]):
        group_of_slot = phy2log[layer] // group_size
        for group in range(num_groups):
            assert node_of_slot[group_of_slot == group].unique().numel() == 1
        for node in range(num_nodes):  # and every node holds the same number of groups
            assert group_of_slot[node_of_slot == node].unique().numel() == num_groups // num_nodes


@settings(max_examples=60, deadline=None)
@given(cfg=configs())
def test_deepseek_swap_never_less_balanced_than_deepseek(cfg):
    weight, num_replicas, num_groups, num_nodes, num_gpus = cfg
    base = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    swapped = get_policy("deepseek_swap")(weight, num_replicas, num_groups, num_nodes, num_gpus)
    before = simulate_ep(weight, base[0], base[2], num_gpus, num_nodes)
    after = simulate_ep(weight, swapped[0], swapped[2], num_gpus, num_nodes)
    assert (after.rank_load.amax(-1) <= before.rank_load.amax(-1) + 1e-9).all()
    assert torch.equal(swapped[2], base[2]), "swaps move replicas, they never add or drop one"


def random_load(seed, num_layers, num_logical, family):
    gen = torch.Generator().manual_seed(seed)
    if family == "zipf":
        ranks = torch.stack([torch.randperm(num_logical, generator=gen) for _ in range(num_layers)]) + 1
        popularity = ranks.double() ** -(0.3 + 1.2 * torch.rand(1, generator=gen, dtype=torch.float64))
    elif family == "lognormal":
        sigma = 0.2 + 1.8 * torch.rand(1, generator=gen, dtype=torch.float64)
        popularity = (torch.randn(num_layers, num_logical, generator=gen, dtype=torch.float64) * sigma).exp()
    else:
        popularity = -torch.rand(num_layers, num_logical, generator=gen, dtype=torch.float64).log()
    tokens = popularity / popularity.sum(-1, keepdim=True) * 20000
    return torch.poisson(tokens, generator=gen)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_logical=st.sampled_from([32, 64, 128, 256]),
       num_gpus=st.sampled_from([2, 4, 8, 16]), redundancy=st.sampled_from([0, 8, 4, 2]),
       num_nodes=st.sampled_from([1, 2]), family=st.sampled_from(["zipf", "lognormal", "exp"]))
@example(seed=83919, num_logical=64, num_gpus=2, redundancy=0, num_nodes=1, family="zipf")
def test_deepseek_global_and_lpt_never_less_balanced_than_none(seed, num_logical, num_gpus, redundancy,
                                                               num_nodes, family):
    """On randomized loads (Zipf, lognormal, exponential popularity with Poisson noise) deepseek's
    global policy and lpt balance at least as well as the identity, or within 1 % of perfect where the
    identity happens to be nearly perfect too (the pinned example: 0.9949 against the identity's 0.9965, 32
    experts a GPU). Adversarial loads can beat any greedy packing; see test_known_cases_where_identity_wins."""
    extra = num_logical // redundancy if redundancy else 0
    num_replicas = -(-(num_logical + extra) // num_gpus) * num_gpus
    weight = random_load(seed, 2, num_logical, family)
    none = get_policy("none")(weight, num_replicas, 1, num_nodes, num_gpus)
    base = simulate_ep(weight, none[0], none[2], num_gpus, num_nodes).balancedness
    for name, groups in (("deepseek", 1 if num_nodes == 1 else 3), ("lpt", 4)):
        out = get_policy(name)(weight, num_replicas, groups, num_nodes, num_gpus)
        assert simulate_ep(weight, out[0], out[2], num_gpus, num_nodes).balancedness >= min(base - 1e-12, 0.99), name


def test_known_cases_where_identity_wins():
    """Pins two limits of DeepSeek EPLB, so nobody claims more than it does.
    1. Greedy LPT is not optimal: loads [3, 3, 0, 2, 2, 2] on 2 GPUs; identity gets 6 | 6, LPT 7 | 5.
    2. Hierarchical balancing replicates only within a node: one hot group per node cannot borrow
       the other node's slots, while the identity's round-robin redundant slots happen to."""
    w = torch.tensor([[3, 3, 0, 2, 2, 2]])
    for name, expected in (("none", 1.0), ("deepseek", 6 / 7)):
        out = get_policy(name)(w, 6, 1, 1, 2)
        assert simulate_ep(w, out[0], out[2], 2).balancedness == pytest.approx(expected)
    w = torch.tensor([[4, 0, 1, 1]])
    for name, expected in (("none", 1.0), ("deepseek", 0.75)):
        out = get_policy(name)(w, 6, 2, 2, 2)
        assert simulate_ep(w, out[0], out[2], 2, 2).balancedness == pytest.approx(expected)


def test_none_is_identity_with_round_robin_redundancy():
    phy2log, log2phy, logcnt = get_policy("none")(torch.ones(2, 4), 10, 1, 1, 2)
    assert phy2log[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert logcnt[1].tolist() == [3, 3, 2, 2]
    assert log2phy[0, 0].tolist() == [0, 4, 8] and log2phy[0, 3].tolist() == [3, 7, -1]


def test_snake_deals_boustrophedon():
    # 4 experts, no redundancy, 2 GPUs: sorted loads 8, 4, 2, 1 -> GPU0 {8, 1}, GPU1 {4, 2}
    phy2log, _, _ = get_policy("snake")(torch.tensor([[1.0, 8.0, 2.0, 4.0]]), 4, 1, 1, 2)
    assert phy2log[0].tolist() == [1, 0, 3, 2]


def test_lpt_ignores_nodes_and_deepseek_does_not():
    """One hot group: hierarchical deepseek must replicate it inside its node, lpt anywhere."""
    weight = torch.tensor([[100.0, 100.0, 1.0, 1.0]])
    ds = rebalance_experts(weight, 8, 2, 2, 4)
    lpt = get_policy("lpt")(weight, 8, 2, 2, 4)
    b_ds = simulate_ep(weight, ds[0], ds[2], 4, 2).balancedness
    b_lpt = simulate_ep(weight, lpt[0], lpt[2], 4, 2).balancedness
    assert b_lpt > b_ds
    assert set(ds[0][0, :4].tolist()) == {0, 1}  # node 0 holds only the hot group's replicas


def test_accepts_numpy_and_int_and_any_device_input():
    a = rebalance_experts(README_WEIGHT.numpy(), 16, 4, 2, 8)
    b = rebalance_experts(README_WEIGHT.float(), 16, 4, 2, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert isinstance(np.asarray(a[0]), np.ndarray)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(2, 12), 18, 4, 2, 8), "divisible by num_gpus"),
        ((torch.ones(2, 12), 8, 4, 2, 8), r"num_replicas \(8\) must be >= the number of logical experts"),
        ((torch.ones(2, 12), 16, 4, 3, 8), r"num_gpus \(8\) must be divisible by num_nodes \(3\)"),
        ((torch.ones(12), 16, 4, 2, 8), "2-D tensor"),
        ((torch.ones(2, 0), 16, 4, 2, 8), "2-D tensor"),
        ((-torch.ones(2, 12), 16, 4, 2, 8), "finite and >= 0"),
        ((torch.full((2, 12), float("nan")), 16, 4, 2, 8), "finite and >= 0"),
        ((torch.ones(2, 12), 16, 0, 2, 8), "num_groups must be a positive integer"),
    ],
)
def test_invalid_arguments_name_the_constraint(name, args, match):
    with pytest.raises(ValueError, match=match):
        get_policy(name)(*args)


def test_deepseek_hierarchical_needs_groups_to_divide_experts():
    with pytest.raises(ValueError, match=r"logical experts \(10\) must be divisible by num_groups \(4\)"):
        rebalance_experts(torch.ones(1, 10), 16, 4, 2, 8)
    rebalance_experts(torch.ones(1, 10), 16, 3, 2, 8)  # 3 % 2 != 0: global policy, groups unused


def test_unknown_policy_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown EPLB policy 'nope'.*deepseek.*none"):
        get_policy("nope")


def test_register_a_custom_policy():
    from research_lm.eplb import registry

    @registry.register_policy("test_reverse")
    def reverse(weight, num_replicas, num_groups, num_nodes, num_gpus):
        out = get_policy("none")(weight, num_replicas, num_groups, num_nodes, num_gpus)
        return out[0].flip(-1), *out[1:]

    try:
        assert get_policy("test_reverse") is reverse and "test_reverse" in available_policies()
        with pytest.raises(ValueError, match="already registered"):
            registry.register_policy("test_reverse")(lambda *a: None)
    finally:
        registry.POLICIES.entries.pop("test_reverse")


def test_policies_declare_their_traits():
    from research_lm.eplb.registry import PolicyTraits, policy_traits

    assert policy_traits(get_policy("deepseek")) == PolicyTraits()  # summed load, round-robin dispatch
    assert policy_traits(get_policy("deepseek_vec")).history_buckets == 16
    assert policy_traits(get_policy("lplb")).dispatch == "least_loaded"
    assert policy_traits(lambda *a: None) == PolicyTraits()  # any callable: the contract alone
    with pytest.raises(ValueError, match=r"unknown dispatch rule 'fastest'; choose one of \['round_robin'"):
        PolicyTraits(dispatch="fastest")


def test_lplb_places_like_deepseek():
    out, ds = get_policy("lplb")(README_WEIGHT, 16, 4, 2, 8), rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(out, ds))


def test_deepseek_vec_on_one_bucket_replicates_like_deepseek_global():
    weight = random_load(3, 4, 64, "zipf")
    vec = get_policy("deepseek_vec")(weight, 80, 1, 1, 8)
    assert torch.equal(vec[2], get_policy("lpt")(weight, 80, 1, 1, 8)[2])  # replica counts: D'Hondt on the sum


def test_deepseek_vec_balances_each_bucket_not_the_sum():
    """Experts 0 and 2 are hot in bucket 0, 1 and 3 in bucket 1: every sum is equal, so packing by the sum pairs
    0 with 2 (each bucket then has one GPU with 20 and one with 0); the history pairs each hot expert with a
    cold one (10 and 10 in both buckets)."""
    history = torch.tensor([[[10.0, 0.0, 10.0, 0.0]], [[0.0, 10.0, 0.0, 10.0]]])  # [B=2, L=1, E=4]
    by_sum = get_policy("lpt")(history.sum(0), 4, 1, 1, 2)
    vec = get_policy("deepseek_vec")(history, 4, 1, 1, 2)
    for out, expected in ((by_sum, 20.0), (vec, 10.0)):
        per_bucket = [simulate_ep(history[b], out[0], out[2], 2).rank_load.amax() for b in range(2)]
        assert [float(x) for x in per_bucket] == [expected, expected]
    with pytest.raises(ValueError, match="finite and >= 0"):
        get_policy("deepseek_vec")(-history, 4, 1, 1, 2)


def test_budgeted_keeps_replicas_where_they_pay():
    """Layer 0 is uniform (replicas buy nothing), layer 1 has one hot expert: the budget goes to layer 1, and a
    GPU's unused slots hold copies of an expert it already has (counted once by slots_used)."""
    from research_lm.eplb.metrics import slots_used

    weight = torch.tensor([[10.0] * 8, [80.0] + [10.0] * 7])
    phy2log, _, logcnt = get_policy("budgeted")(weight, 12, 1, 1, 4, slot_budget=0.5)  # 4 of 8 redundant slots
    used = slots_used(phy2log, 4)
    assert used[0] == 8 and 8 < used[1] <= 8 + 4  # layer 1: as many as lower its max (3: 40 = 4 would too)
    assert simulate_ep(weight[1:], phy2log[1:], logcnt[1:], 4).rank_load.amax() == 40.0
    for gpu in range(4):  # layer 0: each GPU holds 2 experts, the third slot copies one of them
        slots = phy2log[0, 3 * gpu:3 * gpu + 3].tolist()
        assert len(set(slots)) == 2
    none = get_policy("budgeted")(weight, 12, 1, 1, 4, slot_budget=0.0)
    assert slots_used(none[0], 4).tolist() == [8, 8]
    with pytest.raises(ValueError, match=r"slot_budget must lie in \[0, 1\]"):
        get_policy("budgeted")(weight, 12, 1, 1, 4, slot_budget=1.5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_gpus=st.sampled_from([2, 4, 8]), family=st.sampled_from(["zipf", "exp"]))
def test_budgeted_with_every_slot_never_trails_deepseek_global(seed, num_gpus, family):
    """At slot_budget 1 the knapsack may take DeepSeek's global replication in every layer, so its Σ max GPU load
    is at most lpt's (the same replication and packing), usually with fewer slots."""
    weight = random_load(seed, 3, 32, family) + 1.0  # positive loads: packing ties cannot differ
    num_replicas = -(-(32 + 8) // num_gpus) * num_gpus
    ours = get_policy("budgeted")(weight, num_replicas, 1, 1, num_gpus, slot_budget=1.0)
    lpt = get_policy("lpt")(weight, num_replicas, 1, 1, num_gpus)
    step = [simulate_ep(weight, out[0], out[2], num_gpus).est_step_time for out in (ours, lpt)]
    assert step[0] <= step[1] * (1 + 1e-9)
