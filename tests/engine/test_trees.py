"""Draft trees through the engine (`hal.engine.trees`): one target forward with the tree mask and
positions by depth, `verify_tree`, the accepted path's KV compacted with ``copy_kv``.
Greedy output equals plain greedy whatever the tree; sampled output follows the target's
law (chi-square of the first two tokens against the runner's own probabilities)."""

from __future__ import annotations

import random

import pytest
import torch

import hal
from hal.conformance._helpers import assert_distribution
from hal.engine import Request, SamplingParams, SpeculativeDecoder
from hal.drafters import NgramTreeDrafter
from hal.engine.forward import forward
from hal.kv import KVPool
from hal.models.loaders import load_safetensors
from hal.engine.drafting import Proposal
from hal.models.linear_plan import offered_dtypes
from tests.engine.test_decoder import PROMPTS, N
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return load_safetensors(tiny, hal.get_backend("cpu"))


@pytest.fixture(scope="module")
def plain(model):
    return SpeculativeDecoder(model, None, num_blocks=64).generate([Request(p, max_new_tokens=N, k=0) for p in PROMPTS])


class OracleTree:
    """Knows each prompt's greedy continuation and drafts a tree that hides it: at every
    level a wrong sibling comes first, the right token second (its children continue the
    path), and from a random depth on the 'right' token is wrong too. Accepted nodes are
    therefore never the first slots, so a wrong KV compaction changes the output."""

    def __init__(self, prompts, outputs, V, seed=0):
        self.want = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.V, self.rng, self.trees = V, random.Random(seed), 0

    def propose(self, b):
        ids, parents = [], []
        for i, k in enumerate(b.k):
            hist = b.history[i, :b.lengths[i]].tolist()
            key = next(p for p in self.want if tuple(hist[:len(p)]) == p)
            cont = self.want[key][len(hist) - len(key):]
            good = self.rng.randint(0, k // 2)
            at, toks, par = -1, [], []
            for d in range(k // 2):
                right = cont[d] if d < min(good, len(cont)) else (cont[d] + 2) % self.V if d < len(cont) else 0
                toks += [(right + 1) % self.V, right]
                par += [at, at]
                at = len(toks) - 1
            toks += [0] * (k - len(toks))
            par += list(range(len(par) - 1, k - 1))
            ids += toks
            parents += par
            self.trees += 1
        cu = torch.tensor([0, *b.k]).cumsum(0)
        return Proposal(draft_token_ids=torch.tensor(ids), cu_num_draft_tokens=cu, parent_ids=torch.tensor(parents))

    def commit(self, rids, kept):
        pass

    def release(self, rid):
        pass


@pytest.mark.parametrize("budget,seqs,blocks", [(None, 8, 64), (14, 3, 64), (None, 8, 9)])
def test_greedy_trees_equal_plain_greedy(model, plain, budget, seqs, blocks):
    """Under a token budget (drafts shrink to a prefix of the tree), with requests arriving
    together, and under a pool small enough to preempt."""
    drafter = OracleTree(PROMPTS, plain, model.cfg.vocab)
    dec = SpeculativeDecoder(model, drafter, num_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seqs)
    out = dec.generate([Request(p, max_new_tokens=N, k=6) for p in PROMPTS])
    assert out == plain
    m = dec.metrics.total
    assert drafter.trees and m.num_accepted_tokens > 0, "no tree path was accepted: the test proves nothing"
    assert dec.pool.allocator.num_free == dec.pool.allocator.num_blocks


def test_ngram_trees_are_lossless_and_branch(model, plain):
    drafter = NgramTreeDrafter(model.be, 1, 3)
    seen = []
    real = drafter.propose

    def spy(b):
        prop = real(b)
        seen.append(prop)
        return prop
    drafter.propose = spy
    dec = SpeculativeDecoder(model, drafter, num_blocks=64)
    assert dec.generate([Request(p, max_new_tokens=N, k=5) for p in PROMPTS]) == plain
    assert dec.metrics.total.num_accepted_tokens > 0
    branched = [p for p in seen if len(set(p.parent_ids.tolist())) < p.parent_ids.numel()]
    assert branched, "the n-gram tree never branched"


def test_logprobs_follow_the_accepted_path(model, plain):
    from tests.engine.test_decoder import test_logprobs_match_log_softmax_of_the_target as check
    import tests.engine.test_decoder as te
    real = te.engine
    te.engine = lambda m, drafter="ngram", **kw: SpeculativeDecoder(m, OracleTree(PROMPTS, plain, m.cfg.vocab),
                                                                   num_blocks=64)
    try:
        check(model)
    finally:
        te.engine = real


@pytest.mark.parametrize("how", ["short", "self", "later", "below"])
def test_a_malformed_tree_is_refused_and_changes_nothing(model, how):
    from hal.errors import HalError

    class Bad(OracleTree):
        def propose(self, b):
            p = super().propose(b)
            par = p.parent_ids.clone()
            if how == "short":
                par = par[:-1]
            else:
                par[2] = {"self": 2, "later": 3, "below": -2}[how]
            return Proposal(draft_token_ids=p.draft_token_ids, cu_num_draft_tokens=p.cu_num_draft_tokens, parent_ids=par)
    dec = SpeculativeDecoder(model, Bad(PROMPTS, [[0] * N] * len(PROMPTS), model.cfg.vocab), num_blocks=64)
    rid = dec.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8, k=4))
    dec.step()                                    # the prefill and the first token
    s = dec.running[0]
    before = (list(s.tokens), s.seq.length, s.offset, dec.pool.allocator.num_free)
    with pytest.raises(HalError, match="Proposal.parent_ids"):
        dec.step()
    assert (list(s.tokens), s.seq.length, s.offset, dec.pool.allocator.num_free) == before and rid == s.rid


class TopTree:
    """The tree for the step after the first token x1: the target's two likeliest next tokens
    after x1, each with its own two likeliest successors (deterministic siblings: one-hot q).
    ``top2[x1]`` and ``top3[x1, x2]`` hold those tokens."""

    def __init__(self, top2, top3):
        self.top2, self.top3 = top2, top3

    def propose(self, b):
        ids, par, valid = [], [], []
        for i, k in enumerate(b.k):
            x1 = int(b.history[i, b.lengths[i] - 1])
            a = self.top2[x1].tolist()
            tree = a + self.top3[x1, a[0]].tolist() + self.top3[x1, a[1]].tolist()
            ids += tree[:k] + [0] * max(0, k - 6)
            par += [-1, -1, 0, 0, 1, 1][:k] + list(range(5, k - 1))
            valid.append(min(k, 6))
        cu = torch.tensor([0, *b.k]).cumsum(0)
        return Proposal(draft_token_ids=torch.tensor(ids), cu_num_draft_tokens=cu, num_valid=torch.tensor(valid),
                        parent_ids=torch.tensor(par))

    def commit(self, rids, kept):
        pass

    def release(self, rid):
        pass


BF16 = "bfloat16" in offered_dtypes()


@pytest.mark.parametrize("temperature,dtype", [(1.0, "float32"), (0.7, "float32"), pytest.param(
    1.0, "bfloat16", marks=pytest.mark.skipif(not BF16, reason="this CPU has no bfloat16 unit: no bf16 plan"))])
def test_sampled_trees_keep_the_target_law(model, tiny, temperature, dtype):  # noqa: F811
    """2000 requests (one prompt, different seeds): the first token comes from the prefill,
    the next two through a tree of the target's own top tokens. The second and third tokens
    follow their marginals sum p(x1) p(x2 | x1) (...), all computed by the runner over every
    prefix (chi-square, fixed seeds), at each dtype's linear plan (the law is the target's at
    that dtype)."""
    if dtype != "float32":
        model = load_safetensors(tiny, hal.get_backend("cpu"), dtype)
    prompt, V = PROMPTS[2], model.cfg.vocab
    pool = KVPool(model.be, 3 * V * V, 16, model.cfg.kv_heads, model.cfg.head_dim, dtype=model.dtype,
                  num_layers=model.cfg.layers)
    probs = lambda seqs: torch.softmax(forward(model, pool, [pool.sequence() for _ in seqs], seqs, False)[0]  # noqa
                                       / temperature, -1)
    p1 = probs([prompt])[0]
    p2 = probs([prompt + [x] for x in range(V)])                                   # [x1, x2]
    p3 = probs([prompt + [x, y] for x in range(V) for y in range(V)]).view(V, V, V)  # [x1, x2, x3]
    tree = TopTree(p2.topk(2).indices, p3.topk(2).indices)
    dec = SpeculativeDecoder(model, tree, num_blocks=2000 * 2, max_num_seqs=2000)
    outs = dec.generate([Request(prompt, max_new_tokens=4, k=6, temperature=temperature, seed=s)
                         for s in range(2000)])
    assert dec.metrics.total.num_accepted_tokens > 1000, "the tree was rarely accepted: the test proves little"
    p12 = p1[:, None] * p2
    assert_distribution(torch.tensor([o[1] for o in outs]), p12.sum(0), "second token (through a tree)")
    assert_distribution(torch.tensor([o[2] for o in outs]), (p12[..., None] * p3).sum((0, 1)),
                        "third token (through a tree)")
