import pytest
import torch

import hal


def test_counters_match_vllm_definitions():
    m = hal.SpecDecodeMetrics()
    m.observe(torch.tensor([3, 3, 0]), torch.tensor([3, 1, 0]), ["a", "b", "c"])
    m.observe([3, 2], [0, 2], ["a", "b"])
    t = m.total
    assert (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens) == (4, 11, 6)
    assert t.accepted_per_position == [3, 2, 1]
    assert m.acceptance_rate == pytest.approx(6 / 11)
    assert m.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert t.acceptance_by_position() == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert m.requests["a"].num_accepted_tokens == 3 and m.requests["c"].num_drafts == 0
    assert m.requests["b"].mean_acceptance_length == pytest.approx(1 + 3 / 2)


def test_bad_counts_are_errors():
    m = hal.SpecDecodeMetrics()
    with pytest.raises(hal.HalError):
        m.observe([2], [3])
    with pytest.raises(hal.HalError):
        m.observe([2, 1], [1])
