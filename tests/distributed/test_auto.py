"""`hal.distributed.auto.choose` on injected device profiles whose optimum is known by hand:
plain decoding when drafts cost more than they save, the draft beside the target when it
is cheap, the draft on the slow device when the fast one cannot hold both models, the other
rank when its drafts are ready ahead, and a HalError naming what is missing."""

import json
import os
import re
import subprocess
import sys

import pytest

from hal.distributed.auto import DeviceProfile, LinkProfile, choose
from hal.engine.costs import CostModel
from hal.engine.acceptance import expected_tokens
from hal.errors import HalError
from tests.launch.test_generate import tiny  # noqa: F401  (the model fixture)

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


def test_another_rank_pays_off_only_as_far_as_its_drafts_are_ready_ahead():
    """A draft chain that costs as much as a verify step: in-process it doubles the step. On
    another rank over a 0.2 ms link, the rounds answered from the speculation cache (the
    worker drafted them while the target verified) cost max(verify + link, draft), the others
    verify + link + draft. At a 90% hit rate the other rank wins; at 0% (nothing drafted
    ahead) it is another device plus the link, so the draft stays beside the target."""
    gpu = DeviceProfile("cuda:0", 40 * GB, FAST, {1: 0.002, 6: 0.012})
    peer = DeviceProfile("cuda:1", 40 * GB, FAST, {1: 0.002, 6: 0.012})
    link = LinkProfile(2e-4, 10e9, (peer,))
    got = choose([gpu], **kw(), link=link, hit_rate=0.9)
    assert (got.best.draft, got.best.where) == ("cuda:1", "other rank")
    assert got.runner_up.where in ("same device", "plain")
    k = got.best.k
    verify, wire, draft = FAST.cost(4 * (1 + k), 0, 0), 2e-4 + 4 * k * 8 / 10e9, 0.002 * k
    step = 0.9 * max(verify + wire, draft) + 0.1 * (verify + wire + draft)
    assert got.best.tokens_per_s == pytest.approx(4 * expected_tokens(0.8, k) / step)
    assert "90% speculation-cache hit rate" in got.describe()
    cold = choose([gpu], **kw(), link=link)
    assert cold.best.where == "same device" and cold.hit_rate == 0.0
    remote = next(c for c in cold.table if c.where == "other rank")
    assert remote.tokens_per_s < cold.best.tokens_per_s
    shown = remote in (cold.best, cold.runner_up)
    assert (f"best on the other rank: {remote.describe()}" in cold.describe()) == (not shown)
    assert cold.describe().count("(other rank)") == 1   # named once, wherever it ranks
    slow = choose([gpu], **kw(), link=LinkProfile(0.2, 10e9, (peer,)))   # a 200 ms link: third of three
    assert [c.where for c in slow.table] == ["same device", "plain", "other rank"]
    assert f"; best on the other rank: {slow.table[2].describe()}" in slow.describe()


def test_the_hit_rate_is_a_share_and_only_the_chain_head_drafts_ahead_among_heads():
    from argparse import Namespace
    from hal.drafters.kinds import parse_draft
    from hal.launch.measure import ahead_hit_rate
    with pytest.raises(HalError, match="hit_rate"):
        choose([DeviceProfile("cpu", 40 * GB, FAST, {1: 0.001})], **kw(), hit_rate=1.5)
    args = Namespace(placement_hit_rate=0.7, fanout=8)
    assert ahead_hit_rate(args, parse_draft("ngram")) == 0.7
    assert ahead_hit_rate(Namespace(placement_hit_rate=0.7, fanout=0), parse_draft("ngram")) == 0.0
    assert ahead_hit_rate(args, parse_draft("eagle")) == 0.7          # asked: from its own features
    assert ahead_hit_rate(Namespace(placement_hit_rate=0.7, fanout=None), parse_draft("eagle")) == 0.0   # not asked
    assert ahead_hit_rate(Namespace(placement_hit_rate=0.7, fanout=None), parse_draft("ngram")) == 0.7   # default 8
    for kind in ("ngram+eagle", "eagle-tree", "dspark", "ngram-tree"):
        assert ahead_hit_rate(args, parse_draft(kind)) == 0.0


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


# -- HAL_PLACEMENT=auto at start-up: measured here, and on the other rank --------------------------

def test_local_sides_list_this_machines_devices_once():
    from hal.launch.measure import local_sides
    sides = local_sides()
    assert sides and len({str(s.device) for s in sides}) == len(sides)
    assert "cpu" in {s.device.type for s in sides}
    assert all(s.backend.spec.priority >= 0 for s in sides)   # a planted backend is never placed on


def test_a_published_profile_reads_back_and_a_malformed_one_is_refused():
    import json

    import torch.distributed as dist

    from hal.launch.measure import PROFILE, parse_profile, publish_profile
    store = dist.HashStore()
    publish_profile(store, [DeviceProfile("cuda:1", 3 * GB, None, {1: 0.002, 8: 0.01})], 2e-4, 1e9)
    link = parse_profile(store.get(PROFILE))
    assert link == LinkProfile(2e-4, 1e9, (DeviceProfile("cuda:1", 3 * GB, None, {1: 0.002, 8: 0.01}),))
    good = json.loads(store.get(PROFILE))
    for change, what in ((lambda g: g.update(rtt_s=float("nan")), "rtt_s"),
                         (lambda g: g.update(bandwidth=0), "bandwidth"),
                         (lambda g: g.update(devices=[]), "devices"),
                         (lambda g: g["devices"][0].update(name="../x"), "device name"),
                         (lambda g: g["devices"][0].update(free_bytes=-1), "free_bytes"),
                         (lambda g: g["devices"][0].update(draft={"0": 0.1}), "draft"),
                         (lambda g: g["devices"][0].update(draft={"2": -1.0}), "draft[2]"),
                         (lambda g: g.update(extra=1), "an object with")):
        bad = json.loads(json.dumps(good))
        change(bad)
        with pytest.raises(HalError, match=re.escape(what)):
            parse_profile(json.dumps(bad))
    with pytest.raises(HalError, match="JSON"):
        parse_profile(b"\xff{")


def test_placement_auto_at_start_up_in_one_process(tiny, tmp_path):  # noqa: F811
    """The launcher measures this machine's devices, prints the choice and its runner-up,
    and runs it: greedy output is plain greedy's whatever it chose."""
    from tests.launch.test_generate import plain, serve_args
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "hal.launch",
                        *serve_args(tiny, out, "--draft", "self:2", "--k", "3")],
                       env={**os.environ, "HAL_PLACEMENT": "auto"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("placement auto: target on"))
    assert "runner-up: target on" in line and line.count("tok/s predicted") == 2
    assert json.loads(out.read_text())["outputs"] == plain(tiny, "cpu")


def test_placement_auto_across_two_ranks(tiny, tmp_path):  # noqa: F811
    """Under torchrun the worker measures its devices and the link and publishes them; the
    target chooses among its own devices and the other rank's. Either way, plain greedy."""
    from tests.launch.test_generate import plain, serve_args, torchrun
    out = tmp_path / "o.json"
    r = torchrun(serve_args(tiny, out, "--draft", "ngram", "--k", "3"), {"HAL_PLACEMENT": "auto"})
    line = next(x for x in r.stderr.splitlines() if x.startswith("placement auto: target on"))
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu")
    if "(other rank)" in line.split("; runner-up")[0]:
        assert got["world_size"] == 2 and got["rounds"] > 0
    else:
        assert got["world_size"] == 1 and "this rank exits" in r.stderr
    assert "(other rank)" in line   # the other rank was a candidate (its profile crossed), wherever it ranked
