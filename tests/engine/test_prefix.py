"""Automatic prefix caching in the engine (`hal.engine.prefix`, `hal.kv`): requests whose
tokens start the same prefill from their first uncached block, and every output is
identical to the same engine without the cache (greedy and seeded sampling, with drafts,
under preemption and abort). The allocator's own rules are the KV state machine's
(`hal.conformance.test_kv_state`)."""

import random

import pytest

import hal
from hal.drafters import NgramDrafter
from hal.engine import Request, SamplingParams, SpeculativeDecoder
from hal.models.loaders import load_safetensors
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)

BS = 4
SYSTEM = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 3, 1, 9, 2, 7, 5, 8, 6, 1, 2, 2, 9, 4, 3, 7, 8, 1]   # 7 blocks of 4


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return load_safetensors(tiny, hal.get_backend("cpu"))


def engine(model, caching, drafter=True, **kw):
    return SpeculativeDecoder(model, NgramDrafter(model.be) if drafter else None, enable_prefix_caching=caching,
                              **{"num_blocks": 96, "block_size": BS, **kw})


def run(dec, batches):
    """Each batch of requests runs to the end before the next is added; outputs in order."""
    return [out for batch in batches for out in dec.generate(batch)]


def chat(i, **kw):
    return Request(SYSTEM + [10 + i, 11 + i, 12 + 2 * i], **{"max_new_tokens": 10, "k": 3, **kw})


def test_shared_system_prompt_hits_and_output_is_unchanged(model):
    batches = [[chat(i)] for i in range(4)]
    on, off = engine(model, None), engine(model, False)
    assert run(on, batches) == run(off, batches)
    queries, hits = on.prefix_cache_stats
    assert hits == 3 * len(SYSTEM), f"every later request should find the 28-token system prompt, got {hits}"
    assert queries == 4 * (len(SYSTEM) + 3) and off.prefix_cache_stats == (0, 0)
    assert on.pool.allocator.num_free == on.pool.allocator.num_blocks


def test_n_copies_at_once_compute_the_prompt_once(model):
    """Requests added together with one prompt: the first prefills it, the others wait one
    step and take its blocks (``n > 1``); each sample keeps its own seed stream."""
    reqs = [Request(SYSTEM + [40, 41], max_new_tokens=8, k=3, temperature=0.8, seed=5 + i) for i in range(4)]
    on, off = engine(model, None), engine(model, False)
    assert on.generate(reqs) == off.generate(reqs)
    assert on.prefix_cache_stats[1] == 3 * len(SYSTEM)


def test_a_follow_up_turn_reuses_the_blocks_its_answer_wrote(model):
    """Turn 2 is turn 1's prompt + answer + more: blocks written by decoding (and by
    verified drafts) are cached as well as prefilled ones."""
    first = chat(0, max_new_tokens=16)
    on, off = engine(model, None), engine(model, False)
    a_on, a_off = on.generate([first])[0], off.generate([first])[0]
    assert a_on == a_off
    follow = Request(first.prompt_ids + a_on + [30, 31], max_new_tokens=10, k=3)
    assert on.generate([follow]) == off.generate([follow])
    hits = on.prefix_cache_stats[1]
    assert hits >= (len(first.prompt_ids) + len(a_on) - 1) // BS * BS - BS, hits


@pytest.mark.parametrize("drafter", [False, True])
def test_preemption_and_eviction_leave_output_unchanged(model, drafter):
    """A pool that holds about two requests: requests preempt each other, cached blocks are
    evicted for new ones, and a preempted request recomputes from its own cached blocks.
    Sampled requests only without drafts: under memory pressure the cache changes how many
    drafts fit a step, and a sampled request's draws depend on that (greedy ones do not)."""
    rng = random.Random(3)
    temps = [0.0] if drafter else [0.0, 0.7]
    reqs = [Request(SYSTEM[:rng.randint(9, 28)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 9))],
                    max_new_tokens=12, k=2, temperature=rng.choice(temps), seed=i) for i in range(8)]
    on, off = engine(model, None, drafter, num_blocks=20, max_num_seqs=4), engine(model, False, drafter,
                                                                                   num_blocks=20, max_num_seqs=4)
    assert on.generate(reqs) == off.generate(reqs)
    assert on.preemptions > 0 and on.pool.allocator.evictions > 0 and on.prefix_cache_stats[1] > 0
    assert on.pool.allocator.num_free == on.pool.allocator.num_blocks


def test_abort_mid_prefill_and_mid_decode_then_reuse(model):
    on, off = engine(model, None, max_num_batched_tokens=8, max_num_seqs=2), engine(model, False)
    a = on.add_request(SYSTEM + [45], SamplingParams(max_new_tokens=20, k=3))
    on.step()                      # 8 of its 29 prompt tokens are in
    assert on.abort(a)
    b = on.add_request(SYSTEM + [46], SamplingParams(max_new_tokens=20, k=3))
    for _ in range(8):
        on.step()
    assert on.abort(b)
    while on.has_unfinished():
        on.step()
    again = [chat(5), Request(SYSTEM + [45], max_new_tokens=6, k=3)]
    assert on.generate(again) == off.generate(again)
    assert on.pool.allocator.num_free == on.pool.allocator.num_blocks


def test_a_draft_models_pool_caches_the_prompt_too(model):
    """A draft model (the target's first layer) starts later requests on the blocks its own
    pool cached for the shared system turn (the target's names): the drafts, hence the
    acceptance, are what they are without the cache, and so is the output."""
    from hal.drafters import ModelDrafter

    def run_with(caching):
        dec = SpeculativeDecoder(model, ModelDrafter(model.layer_view(1), num_blocks=96, block_size=BS),
                                 enable_prefix_caching=caching, num_blocks=96, block_size=BS)
        outs = run(dec, [[chat(i)] for i in range(3)])
        return outs, dec.metrics.total.num_accepted_tokens, dec.drafter.prefix_hits
    on, off = run_with(None), run_with(False)
    assert on[:2] == off[:2]
    assert on[2] == 2 * len(SYSTEM) and off[2] == 0


def test_a_full_draft_pool_keeps_the_prefix_cache_of_the_requests_it_drafts_for(model):
    """When the draft pool cannot hold every request, `ModelDrafter` drafts for a sub-batch
    (`hal.drafters.batching.subset`); that sub-batch used to lose the target's block names, so
    the requests it kept silently missed the draft pool's prefix cache. Here the system turn
    is cached by a first request; then two more arrive together in a pool too small for both:
    one is left without drafts, and the one drafted for starts on the cached blocks."""
    from hal.drafters import ModelDrafter
    drafter = ModelDrafter(model.layer_view(1), num_blocks=16, block_size=BS)
    dec = SpeculativeDecoder(model, drafter, num_blocks=96, block_size=BS)
    dec.generate([chat(0)])
    hits = drafter.prefix_hits
    outs = dec.generate([chat(1), chat(2)])
    assert drafter.pool_full > 0, "the pool held both: the case is not exercised"
    assert drafter.prefix_hits > hits, "a request drafted for in a sub-batch missed the draft pool's prefix cache"
    plain = SpeculativeDecoder(model, None, num_blocks=96, block_size=BS).generate([chat(1), chat(2)])
    assert outs == plain
