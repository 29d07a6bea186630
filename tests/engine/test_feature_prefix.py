"""Prefix caching with a drafter that reads the target's features (`hal.engine.feature_cache`):
a request admitted on cached blocks passes its drafter the cached blocks' feature rows, bit for
bit the rows a full prefill gives it, so drafts, acceptance and output are what they are without
the cache; a planted cache that hands back another position's rows is caught."""

import pytest
import torch

import hal
from hal.engine import Request, SpeculativeDecoder, prefix  # noqa: F401
from hal.engine.feature_cache import FeatureCache
from hal.models.loaders import load_safetensors
from tests.engine.test_prefix import BS, SYSTEM, chat
from tests.engine.test_syncs import random_head
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return load_safetensors(tiny, hal.get_backend("cpu"))


class Recorder:
    """The drafter it wraps, plus every feature row it was passed, per request, in order."""

    def __init__(self, inner):
        self.inner, self.rows = inner, {}

    features = property(lambda self: self.inner.features)
    shadow = property(lambda self: self.inner.shadow)

    def propose(self, batch):
        at = 0
        for rid, n in zip(batch.rids, batch.num_features or ()):
            self.rows.setdefault(rid, []).append(batch.features[at:at + n].clone())
            at += n
        return self.inner.propose(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def passed(self, rid) -> torch.Tensor:
        return torch.cat(self.rows[rid])


def run(model, caching, batches, **kw):
    from hal.drafters.eagle import EagleDrafter
    rec = Recorder(EagleDrafter(random_head(model), num_blocks=96, block_size=BS))
    dec = SpeculativeDecoder(model, rec, enable_prefix_caching=caching, **{"num_blocks": 96, "block_size": BS, **kw})
    outs = [o for batch in batches for o in dec.generate(batch)]
    return outs, rec, dec


def test_cached_blocks_pass_the_head_the_same_features_and_drafts(model):
    batches = [[chat(i, max_new_tokens=12)] for i in range(3)]
    on, rec_on, dec_on = run(model, None, batches)
    off, rec_off, dec_off = run(model, False, batches)
    plain = SpeculativeDecoder(model, None, num_blocks=96, block_size=BS, enable_prefix_caching=False)
    assert on == off == [o for b in batches for o in plain.generate(b)]
    assert dec_on.prefix_cache_stats[1] == 2 * len(SYSTEM) and dec_off.prefix_cache_stats == (0, 0)
    assert dec_on.cached_features is not None and dec_off.cached_features is None
    for rid in range(3):   # every position's row once, in order, equal bit for bit
        got, want = rec_on.passed(rid), rec_off.passed(rid)
        assert got.shape == want.shape and torch.equal(got, want), rid
    m_on, m_off = dec_on.metrics.total, dec_off.metrics.total
    assert (m_on.num_draft_tokens, m_on.num_accepted_tokens) == (m_off.num_draft_tokens, m_off.num_accepted_tokens)
    assert m_on.num_draft_tokens > 0


def test_a_follow_up_turn_starts_on_the_blocks_its_answer_wrote(model):
    """Turn 2 is turn 1's prompt + answer + more: the rows of blocks written by decoding are
    cached too, and passed as a full prefill of turn 2 would pass them."""
    first = chat(0, max_new_tokens=16)
    (a_on,), rec_on, dec_on = run(model, None, [[first]])
    (a_off,), rec_off, dec_off = run(model, False, [[first]])
    follow = [Request(first.prompt_ids + a_on + [30, 31], max_new_tokens=10, k=3)]
    assert a_on == a_off and dec_on.generate(follow) == dec_off.generate(follow)
    assert dec_on.prefix_cache_stats[1] >= (len(first.prompt_ids) + len(a_on) - 1) // BS * BS - BS
    assert torch.equal(rec_on.passed(1), rec_off.passed(1))


def test_a_cache_that_hands_back_another_positions_rows_is_caught(model):
    """PLANTED: the cached rows shifted by one position. The output stays exact (drafts are
    verified), so only the rows passed show it: the check above must see the difference."""
    batches = [[chat(i, max_new_tokens=8)] for i in range(2)]
    _, rec_off, _ = run(model, False, batches)
    from hal.drafters.eagle import EagleDrafter
    rec = Recorder(EagleDrafter(random_head(model), num_blocks=96, block_size=BS))
    dec = SpeculativeDecoder(model, rec, num_blocks=96, block_size=BS)
    take = dec.cached_features.take
    dec.cached_features.take = lambda names: take(names).roll(1, 0)
    for b in batches:
        dec.generate(b)
    assert dec.prefix_cache_stats[1] > 0
    assert not torch.equal(rec.passed(1), rec_off.passed(1))


def test_a_small_feature_cache_keeps_the_shared_prefix(model):
    """Room for the rows of 12 blocks: each request names 10 (the 7 of the system turn, then its
    own), so the cache evicts; a finished request's own tail goes first, and each later request
    still starts on all 7 shared blocks. Preemption recomputes from what is cached."""
    block = random_head(model).cfg.hidden * 4 * BS   # one block's rows, float32
    batches = [[chat(i, max_new_tokens=10)] for i in range(3)]
    on, _, dec = run(model, None, batches, feature_cache_bytes=12 * block)
    off, _, _ = run(model, False, batches)
    assert on == off
    assert dec.prefix_cache_stats[1] == 2 * len(SYSTEM), dec.prefix_cache_stats
    assert len(dec.cached_features) <= 12 and dec.cached_features.evictions > 0
    reqs = [Request(SYSTEM[:12 + 3 * i] + [20 + i, 21], max_new_tokens=12, k=2) for i in range(6)]
    on, _, dec = run(model, None, [reqs], num_blocks=16, max_num_seqs=4)
    off, _, _ = run(model, False, [reqs], num_blocks=16, max_num_seqs=4)
    assert on == off and dec.preemptions > 0 and dec.prefix_cache_stats[1] > 0


def test_the_block_drafter_with_prefix_caching_equals_plain_greedy():
    from hal.drafters.dspark import DSparkDrafter
    from hal.models.dspark import DSparkModel
    from hal.models.llama import random_llama
    from tests.drafters.test_dspark import D, FFN, H, HEADS, KV, LAYERS, V, trained
    target = random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)
    model = DSparkModel(trained(target).cfg, trained(target).weights(), target)
    system = list(range(2, 40))
    reqs = [[Request(system + [50 + i, 60 + i], max_new_tokens=16, k=3)] for i in range(3)]
    plain = SpeculativeDecoder(target, None)
    want = [o for b in reqs for o in plain.generate(b)]
    dec = SpeculativeDecoder(target, DSparkDrafter(model))
    assert [o for b in reqs for o in dec.generate(b)] == want
    assert dec.prefix_cache_stats[1] == 2 * (len(system) // 16 * 16) and dec.metrics.total.num_draft_tokens > 0


def test_the_feature_cache_keeps_whole_named_blocks():
    c = FeatureCache(block_size=2, max_blocks=3, cached=lambda name: name != b"z")
    rows = torch.arange(10.0)[:, None]
    c.add(0, 0, rows[:3], [b"a"])              # positions 0-2; block a (0-1) is named
    assert c.leading([b"a", b"b"]) == 1 and torch.equal(c.take([b"a"]), rows[:2])
    c.add(0, 3, rows[3:6], [b"a", b"b", b"c"])
    assert c.leading([b"a", b"b", b"c"]) == 3 and torch.equal(c.take([b"a", b"b", b"c"]), rows[:6])
    c.add(0, 6, rows[6:8], [b"a", b"b", b"c", b"d"])   # a fourth block: the prefix's last goes
    assert c.leading([b"a", b"b", b"c"]) == 2 and c.leading([b"d"]) == 1 and c.evictions == 1
    assert c.resume(1, [b"a"])[0].equal(rows[:2])
    c.add(1, 9, rows[9:], [b"a", b"x"])        # not where its tail ends: a new tail, nothing cached
    assert c.leading([b"x"]) == 0
    c.release(0)
    c.release(1)
    c.add(2, 0, rows[:2], [b"z"])               # z's KV block is gone: its rows go first
    c.add(2, 2, rows[2:4], [b"z", b"y"])
    assert c.leading([b"z"]) == 0 and c.leading([b"a", b"b"]) == 2 and len(c) == 3


def test_bad_switches_and_bounds_are_refused(model):
    assert prefix.enabled(None) and prefix.enabled(True) and not prefix.enabled(False)
    with pytest.raises(hal.HalError, match="enable_prefix_caching: expected None, True or False"):
        prefix.enabled("yes")
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(hal.HalError, match="feature_cache_bytes: expected an int >= 0"):
            SpeculativeDecoder(model, None, num_blocks=8, block_size=BS, feature_cache_bytes=bad)
