"""An EAGLE head asked for no drafts (n-gram lookup covered the request, or a batch-mate drafted)
holds its new features and feeds them with its next draft: no head forward until then, the same
first drafts as a head fed every step."""

import torch

from hal.drafters.eagle import EagleDrafter
from hal.engine.requests import Request
from hal.models.eagle_layouts import load_eagle
from tests.drafters.test_eagle import DRAFT, V, eagle1, head_logits, target, target_features  # noqa: F401


def test_a_head_asked_for_nothing_holds_its_features_and_drafts_as_if_fed_every_step(target, tmp_path, monkeypatch):
    """A call with k = 0 (n-gram lookup covered the request, or a batch-mate drafted) runs no head forward:
    the new features are held, up to `HOLD` rows, then fed; either way the next first draft is the
    from-scratch recompute's argmax, and a release drops what is held."""
    import hal.drafters.eagle as eagle
    from hal.engine.drafting import DraftBatch
    monkeypatch.setattr(eagle, "HOLD", 4)
    head = load_eagle(eagle1(tmp_path)[1], target)
    forwards = []
    real = head.forward
    head.forward = lambda *a, **k: (forwards.append(1), real(*a, **k))[1]
    d = EagleDrafter(head)
    ids = [(11 * i + 5) % V for i in range(30)]
    f = target_features(target, ids, head.feature_layers)

    def view(L, new, k):
        return DraftBatch(rids=(0,), params=(Request(ids[:L], k=k),), history=torch.tensor([ids]),
                          num_tokens=torch.tensor([L]), lengths=(L,), k=(k,), offsets=(0,), features=f[new],
                          num_features=(new.stop - new.start,))

    def first_draft_ok(p, L):
        ref = head_logits(head, ids[:L], f)[-1]
        assert int(p.draft_token_ids[0]) == int(DRAFT[ref.argmax()])
    first_draft_ok(d.propose(view(8, slice(0, 7), 2)), 8)
    n = len(forwards)
    d.propose(view(11, slice(7, 10), 0))
    assert len(forwards) == n and d.draft_kv.valid_len(0) == 7 and sum(len(x) for x in d.held[0]) == 3
    d.propose(view(13, slice(10, 12), 0))                              # 5 rows > HOLD: all fed now
    assert len(forwards) == n + 1 and d.draft_kv.valid_len(0) == 12 and 0 not in d.held
    d.propose(view(15, slice(12, 14), 0))
    d.propose(view(16, slice(14, 15), 0))
    assert len(forwards) == n + 1 and len(d.held[0]) == 2
    first_draft_ok(d.propose(view(18, slice(15, 17), 2)), 18)            # held rows fed first, then the new
    assert 0 not in d.held
    d.propose(view(20, slice(17, 19), 0))
    d.release(0)
    assert 0 not in d.held and d.draft_kv.valid_len(0) == 0


def test_a_tree_head_that_drafts_nothing_answers_a_tree_of_filler_slots(target, tmp_path):
    """A tree head whose only request lost its features (a gap before the new ones) drafts nothing:
    its k slots are filler, every one a child of the root, none valid."""
    from hal.engine.drafting import DraftBatch
    d = EagleDrafter(load_eagle(eagle1(tmp_path)[1], target), tree=(2, 2))
    ids = [(11 * i + 5) % V for i in range(12)]
    f = target_features(target, ids, d.head.feature_layers)
    p = d.propose(DraftBatch(rids=(0,), params=(Request(ids[:10], k=3),), history=torch.tensor([ids]),
                             num_tokens=torch.tensor([10]), lengths=(10,), k=(3,), offsets=(0,), features=f[5:9],
                             num_features=(4,)))
    assert d.lost == 1 and p.draft_token_ids.numel() == 3
    assert p.parent_ids.tolist() == [-1, -1, -1] and p.num_valid.tolist() == [0]
