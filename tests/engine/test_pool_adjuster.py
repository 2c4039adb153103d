"""The adjuster seam: both rules, built by `build_adjuster`, give the engine every part of `PoolAdjuster`."""

import pytest

from rimuru import LLM
from rimuru.adjuster import Adjuster
from rimuru.cost_adjuster import CostAdjuster
from rimuru.pool_adjuster import PoolAdjuster


@pytest.mark.parametrize("rule, kind", [("paper", Adjuster), ("cost", CostAdjuster)])
def test_both_rules_implement_the_pool_adjuster(family, rule, kind):
    engine = LLM(family[0], progress=False, adjuster=rule).engine
    members = [name for name in vars(PoolAdjuster) if not name.startswith("_")] + list(PoolAdjuster.__annotations__)
    assert type(engine.adjuster) is kind and members
    assert [name for name in members if not hasattr(engine.adjuster, name)] == []


def test_resident_and_fixed_have_no_adjuster(family):
    assert LLM(family[0], progress=False, expert_policy="resident").engine.adjuster is None
