"""The eplb settings added for dispatch, chunked moves and link bandwidths: checked at the edge, one sentence each."""

import pytest

from research_lm.eplb.settings import EplbSettings


@pytest.mark.parametrize(("config", "match"), [
    ({"dispatch": "fastest"}, r"unknown eplb.dispatch 'fastest'; choose one of \['policy', 'round_robin'"),
    ({"dispatch": 1}, r"eplb.dispatch must be a string, got 1"),
    ({"rebalance_layers_per_chunk": 0}, r"eplb.rebalance_layers_per_chunk must be a positive integer or None"),
    ({"nvlink_gbps": "450"}, r"eplb.nvlink_gbps must be a finite number, got '450'"),
    ({"ib_gbps": -1.0}, r"eplb.ib_gbps must be > 0, got -1.0"),
])
def test_new_eplb_keys_are_checked(config, match):
    with pytest.raises(ValueError, match=match):
        EplbSettings.from_dict(config)


def test_dispatch_rule_is_the_policys_unless_set():
    assert EplbSettings.from_dict({"policy": "lplb"}).dispatch_rule() == "least_loaded"
    assert EplbSettings.from_dict({"policy": "deepseek"}).dispatch_rule() == "round_robin"
    assert EplbSettings.from_dict({"policy": "lplb", "dispatch": "round_robin"}).dispatch_rule() == "round_robin"
    assert EplbSettings.from_dict({"policy": "deepseek", "dispatch": "least_loaded"}).dispatch_rule() == "least_loaded"
