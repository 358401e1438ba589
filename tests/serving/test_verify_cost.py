"""The engine's measured verify cost (``dantinox.serving.verify_cost.VerifyCostMeter``) with synthetic times:
the ratio c(B), the first call of a compiled shape left untimed, probing while unmeasured, and the switch-off rule
on the measured cost (off at low acceptance, on at high). No timed assertions."""

import pytest

from dantinox.generation.speculative import PROBE_VERIFIES
from dantinox.serving.request import Request, SamplingOptions
from dantinox.serving.scheduler import Chunk
from dantinox.serving.speculation import SpecConfig, SpecRowStats, plan_speculation
from dantinox.serving.verify_cost import VerifyCostMeter


def measured(plain_step: float, verify: float, B: int = 1, calls: int = 3) -> VerifyCostMeter:
    """A meter that has timed ``calls`` (+1 untimed first) plain 8-step calls and verify calls of bucket B."""
    meter = VerifyCostMeter()
    for _ in range(calls + 1):
        meter.plain(B, 4, 8 * plain_step, steps=8)
        meter.verify(B, 4, verify)
    return meter


def test_cost_is_the_ratio_of_running_medians_per_bucket():
    meter = measured(plain_step=0.010, verify=0.025)
    assert meter.cost(1) == pytest.approx(2.5)
    assert meter.cost(4) == 1.0 and meter.needs_plain(4)            # another bucket: unmeasured
    meter.verify(1, 4, 1.0)                                          # one outlier: the median holds
    assert meter.cost(1) == pytest.approx(2.5)
    for _ in range(5):                                               # the window moves on to the new times
        meter.verify(1, 4, 0.040)
    assert meter.cost(1) == pytest.approx(4.0)


def test_first_call_of_each_shape_is_not_timed_and_probing_until_measured():
    meter = VerifyCostMeter()
    meter.plain(2, 4, 5.0)            # the compiling call: dropped
    assert meter.needs_plain(2)
    meter.plain(2, 4, 0.01)
    assert meter.needs_plain(2)       # one timing is not enough
    meter.plain(2, 8, 0.02)           # a new table bucket compiles too: dropped
    meter.plain(2, 8, 0.01)
    assert not meter.needs_plain(2)
    assert meter.cost(2) == 1.0       # verify unmeasured: optimistic, so verify calls run and get timed
    meter.verify(2, 4, 9.0)
    meter.verify(2, 4, 0.03)
    meter.verify(2, 4, 0.03)
    assert meter.cost(2) == pytest.approx(3.0)


@pytest.mark.parametrize("bad", [dict(seconds=0.0), dict(seconds=-1.0), dict(B=0), dict(steps=0)])
def test_bad_times_name_the_field(bad):
    args = dict(B=1, M=4, seconds=0.1, steps=1) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        VerifyCostMeter().plain(**args)


def chunk(verifies: int, accepted: int) -> Chunk:
    req = Request("r", [1, 2, 3], SamplingOptions(max_new_tokens=64))
    req.output_ids = [0]
    req.num_computed = req.num_tokens - 1
    req.spec = SpecRowStats(verifies, verifies * 4, accepted)
    return Chunk(req, req.num_computed, 1)


def test_switch_off_rule_on_the_measured_cost():
    spec, held = SpecConfig(spec_tokens=4), (lambda c: 8)
    cost = measured(plain_step=0.010, verify=0.020).cost(1)          # c = 2: pays above 1 accepted per call
    low = [chunk(PROBE_VERIFIES, PROBE_VERIFIES // 2)]                # 0.5 accepted per call
    high = [chunk(PROBE_VERIFIES, 3 * PROBE_VERIFIES)]                # 3 accepted per call
    assert plan_speculation(low, spec, held, cost) is None
    assert list(plan_speculation(high, spec, held, cost).values()) == [4]
    assert list(plan_speculation([chunk(0, 0)], spec, held, cost).values()) == [4]   # rows still probe
    # the unmeasured default (1.0) never switches a step off: what the meter is for
    assert plan_speculation(low, spec, held) is not None
