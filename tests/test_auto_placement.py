"""`hal.distributed.auto.choose` on injected device profiles whose optimum is known by hand:
plain decoding when drafts cost more than they save, the draft beside the target when it
is cheap, the draft on the slow device when the fast one cannot hold both models, the other
rank when the link hides the drafting, and a HalError naming what is missing."""

import pytest

from hal.distributed.auto import DeviceProfile, LinkProfile, choose
from hal.engine.router import CostModel, expected_tokens
from hal.errors import HalError

GB = 1 << 30
# the target's forward: 10 ms + 0.1 ms per fed token (memory-bound: batching is nearly free)
FAST = CostModel({1: 0.0101, 64: 0.0164, 512: 0.0612})
SLOW = CostModel({1: 0.101, 64: 0.164, 512: 0.612})


def kw(**over):
    return {"target_bytes": 8 * GB, "draft_bytes": 2 * GB, "batch": 4, "acceptance": 0.8, "max_k": 6, "context": 0,
            **over}


def test_a_cheap_draft_goes_beside_the_target():
    gpu = DeviceProfile("cuda:0", 40 * GB, FAST, {1: 0.001, 8: 0.008})
    got = choose([gpu], **kw())
    assert (got.best.target, got.best.draft, got.best.where) == ("cuda:0", "cuda:0", "same device")
    assert got.runner_up is not None and got.best.tokens_per_s > got.runner_up.tokens_per_s
    step = FAST.cost(4 * (1 + got.best.k), 0, 0) + 0.001 * got.best.k
    assert got.best.tokens_per_s == pytest.approx(4 * expected_tokens(0.8, got.best.k) / step)
    assert "runner-up" in got.describe() and "tok/s predicted" in got.describe()


def test_drafts_that_cost_more_than_they_save_mean_plain_decoding():
    gpu = DeviceProfile("cuda:0", 40 * GB, FAST, {1: 0.05, 8: 0.4})   # each draft costs 5 target steps
    got = choose([gpu], **kw(acceptance=0.3))
    assert got.best.where == "plain" and got.best.draft is None


def test_the_draft_goes_to_the_slow_device_when_the_fast_one_cannot_hold_both():
    """The fast device has room for the target only (memory-bound): the draft goes to the
    slow device, though drafting there costs ten times as much; the target stays fast."""
    gpu = DeviceProfile("cuda:0", 9 * GB, FAST, {1: 0.001, 8: 0.008})
    npu = DeviceProfile("npu:0", 32 * GB, SLOW, {1: 0.002, 8: 0.016})
    got = choose([gpu, npu], **kw())
    assert (got.best.target, got.best.draft, got.best.where) == ("cuda:0", "npu:0", "other device")
    assert all(c.where != "same device" or c.target != "cuda:0" for c in got.table)   # never offered: no room


def test_another_rank_hides_the_drafting_behind_verification():
    """A draft chain that costs as much as a verify step: in-process it doubles the step, on
    another rank over a 0.2 ms link it overlaps the verification."""
    gpu = DeviceProfile("cuda:0", 40 * GB, FAST, {1: 0.002, 6: 0.012})
    peer = DeviceProfile("cuda:1", 40 * GB, FAST, {1: 0.002, 6: 0.012})
    got = choose([gpu], **kw(), link=LinkProfile(2e-4, 10e9, (peer,)))
    assert (got.best.draft, got.best.where) == ("cuda:1", "other rank")
    assert got.runner_up.where in ("same device", "plain")


def test_a_slow_link_keeps_the_draft_in_process():
    gpu = DeviceProfile("cuda:0", 40 * GB, FAST, {1: 0.001, 8: 0.008})
    peer = DeviceProfile("cuda:1", 40 * GB, FAST, {1: 0.001, 8: 0.008})
    got = choose([gpu], **kw(), link=LinkProfile(0.05, 1e6, (peer,)))   # 50 ms round trips
    assert got.best.where == "same device"


def test_nothing_fits_names_what_is_missing():
    with pytest.raises(HalError, match=r"cuda:0 \(1073741824 bytes free\)"):
        choose([DeviceProfile("cuda:0", GB, FAST, {1: 0.001})], **kw())
    with pytest.raises(HalError, match="no target costs"):
        choose([DeviceProfile("cpu", 40 * GB, None, {1: 0.001})], **kw())
    with pytest.raises(HalError, match="acceptance"):
        choose([DeviceProfile("cpu", 40 * GB, FAST)], **kw(acceptance=1.5))


def test_placement_auto_prints_the_choice_and_the_runner_up(capsys):
    from hal.distributed.placement import Placement
    gpu = DeviceProfile("cuda:0", 9 * GB, FAST, {1: 0.001, 8: 0.008})
    npu = DeviceProfile("npu:0", 32 * GB, SLOW, {1: 0.002, 8: 0.016})
    placement, choice = Placement.auto([gpu, npu], **kw())
    assert placement == Placement(draft="npu:0", target="cuda:0")
    err = capsys.readouterr().err
    assert "placement auto: target on cuda:0, draft on npu:0" in err and "runner-up: target on" in err
