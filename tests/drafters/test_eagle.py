"""EAGLE heads: the published EAGLE-1 / EAGLE-3 layouts load (tiny random heads written in
exactly those layouts), the head's KV path equals the training module, the engine passes
every target feature once and in order (each first draft equals a from-scratch recompute),
and greedy output with a head drafter equals plain greedy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import hal
from hal import kv
from hal.engine import SpeculativeDecoder
from hal.models.eagle_layouts import load_eagle
from hal.drafters.eagle import EagleDrafter
from hal.errors import HalError
from hal.engine.forward import forward_tokens, make_batch
from hal.engine.requests import Request
from hal.models.llama import random_llama
from tests.drafters.eagle1_module import Eagle1Module

H, HEADS, KV, D, FFN, V, LAYERS = 64, 4, 2, 16, 128, 96, 8


@pytest.fixture(scope="module")
def target():
    return random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)


def config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "intermediate_size": FFN, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "vocab_size": V, **extra}


DRAFT = torch.tensor(sorted(set(range(0, V, 2)) | {1, 3, 5}))   # a reduced draft vocabulary


def eagle1(tmp_path, seed=0, draft=True):
    """A random EAGLE-1 head in the published layout (+ FR-Spec's d2t), via the training module."""
    torch.manual_seed(seed)
    head = Eagle1Module(H, HEADS, KV, FFN, 10000.0, 1e-5)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    t = {n: x.detach().contiguous() for n, x in head.weights().items()}
    if draft:
        t["d2t"] = DRAFT - torch.arange(len(DRAFT))
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config(draft_vocab_size=len(DRAFT) if draft else V)))
    return head, tmp_path


def eagle3(tmp_path, seed=1, layer_ids=None):
    """A random EAGLE-3 head in exactly the published layout (midlayer.*, fc [H, 3H], lm_head
    over the draft vocabulary, d2t / t2d)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    t = {"fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(len(DRAFT), H),
         "d2t": DRAFT - torch.arange(len(DRAFT)), "t2d": torch.isin(torch.arange(V), DRAFT),
         "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
         "midlayer.post_attention_layernorm.weight": 1 + r(H),
         "midlayer.self_attn.q_proj.weight": r(HEADS * D, 2 * H), "midlayer.self_attn.k_proj.weight": r(KV * D, 2 * H),
         "midlayer.self_attn.v_proj.weight": r(KV * D, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, HEADS * D),
         "midlayer.mlp.gate_proj.weight": r(FFN, H), "midlayer.mlp.up_proj.weight": r(FFN, H),
         "midlayer.mlp.down_proj.weight": r(H, FFN)}
    save_file(t, str(tmp_path / "model.safetensors"))
    extra = {"draft_vocab_size": len(DRAFT)}
    if layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    (tmp_path / "config.json").write_text(json.dumps(config(**extra)))
    return tmp_path


def head_logits(model, ids: list[int], feats: torch.Tensor) -> torch.Tensor:
    """The head's draft-vocabulary logits for pairs (feats[t], ids[t + 1]), from scratch."""
    pool = kv.KVPool(model.be, 8, 16, model.cfg.kv_heads, model.cfg.head_dim, num_layers=1)
    q = pool.sequence()
    toks = torch.tensor(ids[1:])
    b = make_batch(model.be, model.device, pool, [q], [len(toks)], toks, all_rows=True)
    return model.forward(b, pool.k[0], pool.v[0], toks, feats[:len(toks)], True)[0]


def target_features(target, ids: list[int], layers) -> torch.Tensor:
    pool = kv.KVPool(target.be, 8, 16, KV, D, num_layers=LAYERS)
    rows = torch.arange(len(ids))
    return forward_tokens(target, pool, [pool.sequence()], [len(ids)], torch.tensor(ids), rows=rows[-1:],
                          hidden_rows=rows, feature_layers=layers)[1]


def test_eagle1_layout_equals_the_training_module(target, tmp_path):
    train, path = eagle1(tmp_path)
    head = load_eagle(path, target)
    assert head.cfg.version == 1 and head.feature_layers == () and head.cfg.draft_vocab == len(DRAFT)
    ids = [(5 * i + 1) % V for i in range(37)]
    f = target_features(target, ids, ())
    got = head_logits(head, ids, f)
    with torch.no_grad():
        want = train(target.embed[torch.tensor(ids[1:])][None], f[None, :-1])[0] @ target.head[DRAFT].T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_eagle3_layout_taps_three_layers(target, tmp_path):
    head = load_eagle(eagle3(tmp_path), target)
    assert head.cfg.version == 3 and head.feature_layers == (2, LAYERS // 2, LAYERS - 3)
    assert torch.equal(head.draft_ids, DRAFT)
    f = target_features(target, [1, 2, 3, 4], head.feature_layers)
    assert f.shape == (4, 3 * H)
    other = load_eagle(eagle3(tmp_path / "..", layer_ids=[0, 3, 5]), target)
    assert other.feature_layers == (1, 4, 6)     # ids name layer outputs; the runner taps the next layer's input


def lossless(target, drafter, prompts, k=4, **kw):
    plain = SpeculativeDecoder(target, None).generate([Request(p, max_new_tokens=24, k=0) for p in prompts])
    dec = SpeculativeDecoder(target, drafter, **kw)
    spec = dec.generate([Request(p, max_new_tokens=24, k=k) for p in prompts])
    assert spec == plain
    return dec


PROMPTS = [[3, 17, 17, 40, 2, 9], [50, 51, 52], list(range(1, 40, 3)), [7]]


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_head_drafter_is_lossless_and_first_drafts_match_a_recompute(target, tmp_path, layout):
    head = load_eagle(eagle1(tmp_path)[1] if layout == "eagle1" else eagle3(tmp_path), target)
    seen = []

    class Recording(EagleDrafter):
        def propose(self, b):
            p = super().propose(b)
            seen.append((b, p))
            return p
    dec = lossless(target, Recording(head), PROMPTS, max_num_batched_tokens=16, max_num_seqs=4)
    assert dec.metrics.total.num_draft_tokens > 0
    checked = 0
    for b, p in seen:
        cu = p.cu_num_draft_tokens.tolist()
        for i, (L, k) in enumerate(zip(b.lengths, b.k)):
            if k == 0:
                continue
            ids = b.history[i, :L].tolist()
            ref = head_logits(head, ids, target_features(target, ids, head.feature_layers))[-1]
            top2 = ref.topk(2).values
            if top2[0] - top2[1] > 1e-4:    # no near-tie: the drafted id is the recompute's argmax
                assert int(p.draft_token_ids[cu[i]]) == int(DRAFT[ref.argmax()])
                checked += 1
    assert checked >= 10


def test_the_head_attends_on_the_targets_row_kernels_as_the_backend_would(target, tmp_path):
    """The head's RoPE, KV write and attention run on the target's fused row kernels: its
    logits are the backend ops' within 1e-5 of the largest (float32, another summation order),
    and a slot outside the cache is refused before anything is written."""
    head = load_eagle(eagle3(tmp_path), target)
    assert head.rows is target.rows
    ids = [1, 5, 9, 14, 3, 22, 40, 7, 61, 2, 17, 33, 8, 90, 4, 12, 50, 28]
    feats = target_features(target, ids, head.feature_layers)
    fused = head_logits(head, ids, feats)
    head.rows = None   # the backend's checked write_kv and paged_attention
    eager = head_logits(head, ids, feats)
    assert (fused - eager).abs().max() <= 1e-5 * eager.abs().max()
    head.rows = target.rows
    pool = kv.KVPool(head.be, 8, 16, KV, D, num_layers=1)
    toks = torch.tensor(ids[1:4])
    b = make_batch(head.be, head.device, pool, [pool.sequence()], [3], toks, all_rows=True)
    b.slot_mapping[1] = 8 * 16   # PLANTED: a slot past the cache
    before = pool.k[0].clone()
    with pytest.raises(HalError, match="slots"):
        head.forward(b, pool.k[0], pool.v[0], toks, feats[:3], True)
    assert torch.equal(pool.k[0], before)


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_head_tree_is_lossless_and_grows_around_the_chain(target, tmp_path, layout):
    """EAGLE-2 trees (top-3, depth 4, 7 nodes): greedy output equals plain; the tree's first
    node is the chain's first draft and node 0's first child the chain's second (the same
    head from the same features, drafted as a chain beside it); trees do branch."""
    head = load_eagle(eagle1(tmp_path)[1] if layout == "eagle1" else eagle3(tmp_path), target)
    chain, seen = EagleDrafter(head), []

    class Both(EagleDrafter):
        def propose(self, b):
            p = super().propose(b)
            seen.append((b, p, chain.propose(b)))
            return p

        def release(self, rid):
            super().release(rid)
            chain.release(rid)
    dec = lossless(target, Both(head, tree=(3, 4)), PROMPTS, k=7, max_num_batched_tokens=32, max_num_seqs=4)
    assert dec.metrics.total.num_accepted_tokens > 0
    first = second = agree = branched = 0
    for b, t, c in seen:
        cu, par = t.cu_num_draft_tokens.tolist(), t.parent_ids.tolist()
        for i, k in enumerate(b.k):
            if k < 2:
                continue
            tp, ti, ci = par[cu[i]:cu[i + 1]], t.draft_token_ids[cu[i]:cu[i + 1]].tolist(), \
                c.draft_token_ids[cu[i]:cu[i + 1]].tolist()
            assert tp[0] == -1 and all(-1 <= p < j for j, p in enumerate(tp)), "not a tree in parent order"
            first += 1
            agree += ti[0] == ci[0]
            if 0 in tp:
                second += 1
                agree += ti[tp.index(0)] == ci[1]
            branched += len(set(tp)) < len(tp) or tp.count(-1) > 1
    assert first >= 10 and second >= 5 and branched >= 5
    assert agree >= 0.95 * (first + second), f"tree and chain disagree: {agree} of {first + second}"


def test_bad_tree_shapes_are_refused(target, tmp_path):
    from hal.drafters import NgramTreeDrafter
    head = load_eagle(eagle1(tmp_path)[1], target)
    for bad in ((0, 3), (3,), ("a", 2), (2, 0)):
        with pytest.raises(HalError, match="tree: expected"):
            EagleDrafter(head, tree=bad)
    for lo, hi in ((0, 2), (3, 2)):
        with pytest.raises(HalError, match="min_n, max_n"):
            NgramTreeDrafter(target.be, lo, hi)


def test_head_drafter_survives_preemption_and_sampling(target, tmp_path):
    head = load_eagle(eagle1(tmp_path)[1], target)
    lossless(target, EagleDrafter(head), PROMPTS, num_blocks=7, max_num_seqs=4)   # the target pool preempts
    runs = []
    for _ in range(2):
        dec = SpeculativeDecoder(target, EagleDrafter(head))
        runs.append(dec.generate([Request(p, max_new_tokens=16, k=3, temperature=0.8, seed=5) for p in PROMPTS]))
    assert runs[0] == runs[1] and all(len(r) == 16 for r in runs[0])
    lossless(target, EagleDrafter(head, tree=(2, 3)), PROMPTS, k=5, num_blocks=7, max_num_seqs=4)
    trees = [SpeculativeDecoder(target, EagleDrafter(head, tree=(2, 3))).generate(
        [Request(p, max_new_tokens=16, k=5, temperature=0.8, seed=5) for p in PROMPTS]) for _ in range(2)]
    assert trees[0] == trees[1] and all(len(r) == 16 for r in trees[0])


def test_a_full_head_pool_means_no_drafts_not_wrong_ones(target, tmp_path):
    head = load_eagle(eagle1(tmp_path)[1], target)
    d = EagleDrafter(head, num_blocks=2)
    lossless(target, d, PROMPTS)
    assert d.lost > 0


def test_bad_heads_are_refused(target, tmp_path):
    with pytest.raises(HalError, match="config.json"):
        load_eagle(tmp_path / "nothing", target)
    path = eagle3(tmp_path)
    t = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(path / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :2 * H].contiguous()
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(HalError, match=r"head weight fc: expected shape \[64, 192\]"):
        load_eagle(path, target)
    t["fc.weight"] = torch.zeros(H, 3 * H)
    t["d2t"] = t["d2t"] + V
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(HalError, match="d2t"):
        load_eagle(path, target)
    del t["midlayer.hidden_norm.weight"]
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(HalError, match="hidden_norm"):
        load_eagle(path, target)


def test_llama3_rope_scaling_matches_transformers():
    """Published Llama-3.1 EAGLE heads carry rope_scaling (llama3); ours equals transformers'."""
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hal.models.llama import Rope
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = HFConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    want = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].double()
    got = Rope(128, 500000.0, False, scaling).inv_freq
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not torch.allclose(got, Rope(128, 500000.0, False).inv_freq)
    with pytest.raises(HalError, match="rope_scaling"):
        Rope(128, 500000.0, False, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("tree,k", [(None, 4), ((2, 3), 5)])
def test_a_head_on_the_draft_rank_gets_the_features_over_the_link(target, tmp_path, tree, k):
    """EAGLE-3 head in the draft worker (in-process link): every feature crosses once, so its
    drafts (and acceptance) are exactly those of the same head in-process; greedy == plain.
    A tree head's parents cross with its drafts."""
    import queue
    import threading

    from hal.metrics import SpecDecodeMetrics
    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import draft_worker
    from tests.launch.test_generate import QueueLink
    head = load_eagle(eagle3(tmp_path), target)
    local = lossless(target, EagleDrafter(head, tree=tree), PROMPTS, k=k)
    a, b = queue.Queue(), queue.Queue()
    sent = []

    class Counting(QueueLink):
        def send(self, words, rows=None, idx=None):
            sent.append(0 if rows is None else rows.numel() * rows.element_size())
            super().send(words, rows, idx)
    worker = threading.Thread(target=draft_worker, daemon=True, args=(QueueLink(a, b), EagleDrafter(head, tree=tree)),
                              kwargs=dict(fanout=0))   # no drafting ahead: every draft from the target's features
    worker.start()
    metrics = SpecDecodeMetrics()
    remote = RemoteDrafter(Counting(b, a), V, torch.device("cpu"), metrics, timeout=30, features=head.feature_layers)
    dec = lossless(target, remote, PROMPTS, k=k, metrics=metrics)
    remote.close()
    worker.join(timeout=30)
    assert metrics.draft_failures == 0
    assert metrics.total.accepted_per_position == local.metrics.total.accepted_per_position
    assert metrics.total.num_draft_tokens == local.metrics.total.num_draft_tokens > 0
    rows = sum(sent) // (3 * H * 4)                   # features are [T, 3H] float32 rows, each position once
    assert sum(len(p) for p in PROMPTS) < rows <= sum(len(p) for p in PROMPTS) + 24 * len(PROMPTS)
    assert dec.steps > 0


def test_the_head_on_another_backend(target, tmp_path):
    """Placement for heads as for models: the head on the cuda backend (Triton interpreter),
    the target on cpu; features cross devices with `hal.devices.transfer`."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 for the cuda backend on CPU")
    from hal.drafters.kinds import make_drafter, parse_draft
    cuda = hal.get_backend("cuda")
    d = make_drafter(parse_draft(f"eagle:{eagle1(tmp_path)[1]}"), cuda, target, device=cuda.device_type)
    assert d.head.be is cuda
    dec = lossless(target, d, PROMPTS[:2])
    assert dec.metrics.total.num_draft_tokens > 0


def test_ngram_or_head_is_lossless_and_uses_both(target, tmp_path):
    from hal.drafters import NgramDrafter
    from hal.drafters.eagle import NgramOrHead
    head = load_eagle(eagle1(tmp_path)[1], target)
    prompts = PROMPTS + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]          # one copy-heavy prompt: the lookup matches
    calls = []

    class Counting(EagleDrafter):
        def propose(self, b):
            calls.append(sum(b.k))
            return super().propose(b)
    d = NgramOrHead(NgramDrafter(target.be, min_n=2), Counting(head))
    lossless(target, d, prompts)
    assert any(calls)                                          # the head drafted for some requests,
    assert any(c < 4 * len(prompts) for c in calls)            # and not for those the lookup covered
    runs = [SpeculativeDecoder(target, NgramOrHead(NgramDrafter(target.be), EagleDrafter(head))).generate(
        [Request(p, max_new_tokens=12, k=3, temperature=0.7, seed=3) for p in prompts]) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(o) == 12 for o in runs[0])


def test_a_lookup_or_head_drafter_is_profiled_on_its_head(target, tmp_path):
    """The routing profile times a draft chain on a request no lookup matches, so lookup-then-head
    is costed at its dearer path: the head drafts every k profiled (a history of one repeated
    token had the lookup match, and the head's chain was costed as the lookup's)."""
    from hal.drafters import NgramDrafter
    from hal.drafters.eagle import NgramOrHead
    from hal.engine.costs import profile_drafter
    head = load_eagle(eagle1(tmp_path)[1], target)
    asked = []

    class Counting(EagleDrafter):
        def propose(self, b):
            asked.append(b.k)
            return super().propose(b)
    costs = profile_drafter(NgramOrHead(NgramDrafter(target.be, min_n=1), Counting(head)), target.device, H, reps=1)
    assert sorted(costs) == [1, 2, 4, 8] and all(t > 0 for t in costs.values())
    assert sorted({k for ks in asked for k in ks}) == [1, 2, 4, 8]


def test_eagle_drafts_name_what_is_missing(target, tmp_path):
    from hal.models.eagle import shipped_head
    from hal.drafters.kinds import make_drafter, parse_draft
    with pytest.raises(HalError, match="--draft eagle: expected a model with a shipped head") as e:
        shipped_head("no-such-model")
    assert e.value.arg == "--draft"
    with pytest.raises(HalError, match="expected the target model in this process"):
        make_drafter(parse_draft(f"eagle:{tmp_path}"), target.be)
    d = EagleDrafter(load_eagle(eagle1(tmp_path)[1], target))
    b = __import__("hal.engine.drafting", fromlist=["DraftBatch"]).DraftBatch(
        rids=(0,), params=(Request([1, 2]),), history=torch.tensor([[1, 2]]), num_tokens=torch.tensor([2]),
        lengths=(2,), k=(1,), offsets=(0,), num_features=(1,))
    with pytest.raises(HalError, match="DraftBatch.features"):
        d.propose(b)


def test_the_head_runs_its_linears_through_the_targets_plan(target, tmp_path):
    """A batch-invariant target lends the head its linear plan (layout, dtype, chunk widths):
    every linear of the head and its lm_head rows run through the plan's layout, in chunks of
    its widths only, with the training module's logits (fp32, 1e-4: another summation order).
    A plain target lends none, and the head says which it runs."""
    from hal.models.linear_layout import LinearPlan
    from hal.models.llama import Llama
    calls = []

    def layout(x, w):   # the mm layout, recording what it multiplied
        calls.append((x.shape[0], tuple(w.shape)))
        return torch.mm(w, x.T).T

    plan = LinearPlan("mm", torch.float32, (1, 2, 4), fn=layout)
    planned = Llama(target.cfg, dict(target.w), target.be, plan=plan)
    train, path = eagle1(tmp_path)
    head = load_eagle(path, planned)
    assert head.linears == f"the target's plan: {plan.describe()}"
    ids = [(5 * i + 1) % V for i in range(12)]
    f = target_features(target, ids, ())
    got = head_logits(head, ids, f)              # 11 rows: chunks of 4, 4, 4 (the last one padded)
    assert {s for _, s in calls} == {(H, 2 * H), ((HEADS + 2 * KV) * D, H), (H, HEADS * D), (2 * FFN, H),
                                     (H, FFN), (len(DRAFT), H)}
    assert {m for m, _ in calls} == {4}
    with torch.no_grad():
        want = train(target.embed[torch.tensor(ids[1:])][None], f[None, :-1])[0] @ target.head[DRAFT].T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = Llama(target.cfg, dict(target.w), target.be, batch_invariant=False, dtype="float32")
    assert load_eagle(path, plain).linears == "plain F.linear (the target runs plain)"


def head_batch(ids: list[int], k: int, feats=None, own=None, temperature=0.0, F=0):
    """A one-request `DraftBatch` on history ``ids``: ``feats`` the target's new features,
    ``own`` the head's own for an uncommitted tail of ``len(own)`` tokens."""
    from hal.engine.drafting import DraftBatch
    from hal.engine.requests import SamplingParams
    return DraftBatch(rids=(0,), params=(SamplingParams(temperature=temperature, seed=3),), history=torch.tensor([ids]),
                      num_tokens=torch.tensor([len(ids)]), lengths=(len(ids),), k=(k,), offsets=(0,), features=feats,
                      num_features=(0 if feats is None else len(feats),), own_features=own,
                      num_own=() if own is None else (len(own),), alternatives=F)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_tail_fed_with_own_features_drafts_as_if_they_were_the_targets_and_is_never_kept(target, tmp_path,
                                                                                           temperature):
    """Issue 36 item 3: a history ending in an uncommitted tail, fed with features passed as the
    head's own (`DraftBatch.own_features`, here the target's fused by the head's fc), drafts
    exactly what the head drafts when the same rows come as the target's; afterwards the head holds only the target's (its next drafts
    from the real features equal a head that never saw the tail). A chain returns one own
    feature per slot and, asked, each slot's alternatives."""
    head = load_eagle(eagle3(tmp_path), target)
    full = list(range(1, 40, 3)) + [20, 21]
    C, f = len(full) - 2, target_features(target, full, head.feature_layers)
    spec, ref = EagleDrafter(head), EagleDrafter(head)
    first = spec.propose(head_batch(full[:C], 3, f[:C - 1], temperature=temperature, F=4))
    ref.propose(head_batch(full[:C], 3, f[:C - 1], temperature=temperature, F=4))
    assert first.own_features.shape == (3, H) and first.top_ids.shape == (3, 4)   # the head's space: fc's output
    assert int(first.draft_token_ids[0]) in first.top_ids[0].tolist()
    ahead = spec.propose(head_batch(full, 3, own=head.fuse(f[C - 1:C + 1]), temperature=temperature))
    real = ref.propose(head_batch(full, 3, f[C - 1:C + 1], temperature=temperature))
    assert torch.equal(ahead.draft_token_ids, real.draft_token_ids)
    assert spec.draft_kv.valid_len(0) == C - 1                      # the tail's pairs are scratch
    again = spec.propose(head_batch(full, 3, f[C - 1:C + 1], temperature=temperature))
    assert torch.equal(again.draft_token_ids, real.draft_token_ids)
    wrong = EagleDrafter(head)   # PLANTED: the tail's features dropped (the head drafts on the committed prefix alone)
    wrong.propose(head_batch(full[:C], 3, f[:C - 1]))
    assert not torch.equal(wrong.propose(head_batch(full[:C], 3)).draft_token_ids, real.draft_token_ids)


def test_a_head_on_the_draft_rank_drafts_the_next_round_ahead_with_its_own_features(target, tmp_path):
    """The worker's fan-out for an EAGLE head (`hal.distributed.speculate`): each branch's tail
    is fed the head's own features, some COMMITs are answered from the speculation cache, and
    greedy output still equals plain greedy."""
    import queue
    import threading

    from hal.metrics import SpecDecodeMetrics
    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import draft_worker
    from tests.launch.test_generate import QueueLink
    head = load_eagle(eagle3(tmp_path), target)
    a, b = queue.Queue(), queue.Queue()
    worker = threading.Thread(target=draft_worker, daemon=True, args=(QueueLink(a, b), EagleDrafter(head)),
                              kwargs=dict(fanout=16, bounded=False))   # the whole fan-out: hits whatever the timing
    worker.start()
    metrics = SpecDecodeMetrics()
    remote = RemoteDrafter(QueueLink(b, a), V, torch.device("cpu"), metrics, timeout=30, features=head.feature_layers)
    lossless(target, remote, PROMPTS, k=3, metrics=metrics)
    remote.close()
    worker.join(timeout=30)
    assert metrics.draft_failures == 0 and metrics.stale_drafts == 0
    assert metrics.fanout_branches > 0 and remote.cache_hits > 0


def test_own_features_that_do_not_fit_the_head_or_the_tails_are_refused_by_name(target, tmp_path):
    """Misuse of `DraftBatch.own_features` is a `HalError` naming the field, and changes nothing:
    the head's next drafts are those of a head that never saw the bad call."""
    from dataclasses import replace
    head = load_eagle(eagle3(tmp_path), target)
    ids = list(range(1, 30, 2))
    f = target_features(target, ids, head.feature_layers)
    d, ref = EagleDrafter(head), EagleDrafter(head)
    for x in (d, ref):
        x.propose(head_batch(ids[:-2], 3, f[:-3]))
    good = head.fuse(f[-3:-1])
    bad = [(dict(own=good[:1]), "DraftBatch.own_features"),                 # 1 row for a tail of 2 (num_own below)
           (dict(own=f[-3:-1]), "DraftBatch.own_features"),                 # the target's width, not the head's
           (dict(own=good.long()), "DraftBatch.own_features")]
    for kw, field in bad:
        b = head_batch(ids, 3, **kw)
        with pytest.raises(HalError, match=field) as e:
            d.propose(replace(b, num_own=(2,)))
        assert e.value.arg == field
    with pytest.raises(HalError, match="DraftBatch.num_own"):
        d.propose(replace(head_batch(ids, 3, own=good), num_own=(2, 1)))
    with pytest.raises(HalError, match="tree head"):
        EagleDrafter(head, tree=(2, 2)).propose(head_batch(ids, 3, own=good))
    assert torch.equal(d.propose(head_batch(ids, 3, own=good)).draft_token_ids,
                       ref.propose(head_batch(ids, 3, own=good)).draft_token_ids)
