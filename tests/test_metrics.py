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


def test_bad_counts_are_errors_and_count_nothing():
    m = hal.SpecDecodeMetrics()
    with pytest.raises(hal.HalError):
        m.observe([2], [3])
    with pytest.raises(hal.HalError):
        m.observe([2, 1], [1])
    with pytest.raises(hal.HalError):
        m.observe([2, 1], [1, 0], drafters=["ngram"])
    with pytest.raises(hal.HalError):
        m.observe([2, 2], [1, 3], ["a", "b"])   # the second is bad: the first is not counted either
    assert m.total.num_drafts == 0 and not m.requests and not m.by_drafter


def test_per_position_acceptance_per_drafting_method():
    """vLLM's per-position counter, per method: a mixed drafter's rows under the method that
    drafted them; a step without drafts counts for none."""
    pytest.importorskip("prometheus_client", reason="prometheus-client is the optional metrics extra")
    from prometheus_client.parser import text_string_to_metric_families

    from hal.metrics import prometheus_text
    m = hal.SpecDecodeMetrics()
    m.observe([3, 2, 0], [2, 0, 0], ["a", "b", "c"], drafters=["ngram", "eagle3", "eagle3"])
    m.observe([3], [3], ["a"], drafters=["ngram"])
    assert m.by_drafter["ngram"].accepted_per_position == [2, 2, 1] and m.by_drafter["ngram"].num_drafts == 2
    assert m.by_drafter["eagle3"].num_drafts == 1 and m.by_drafter["eagle3"].num_accepted_tokens == 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(prometheus_text(m)) for s in f.samples}
    per_pos = "spec_hal_spec_decode_num_accepted_tokens_per_pos_total"
    assert samples[(per_pos, (("drafter", "ngram"), ("position", "2")))] == 1
    assert samples[("spec_hal_spec_decode_num_drafts_total", (("drafter", "eagle3"),))] == 1


def test_latency_and_prometheus_export():
    pytest.importorskip("prometheus_client", reason="prometheus-client is the optional metrics extra")
    from prometheus_client.parser import text_string_to_metric_families

    from hal.metrics import percentile, prometheus_text
    m = hal.SpecDecodeMetrics()
    m.observe([3, 3], [3, 1], ["a", "b"])
    for rid, first, last, n in (("a", 0.1, 1.1, 11), ("b", 0.2, 0.7, 6)):
        m.first_token(rid, first)
        m.finished(rid, last, n)
    m.draft_failures = 1
    assert m.ttft == [0.1, 0.2] and m.tpot == pytest.approx([0.1, 0.1]) and m.e2e == [1.1, 0.7]
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0 and percentile([1.0] * 99 + [9.0], 99) == 1.0
    fams = {f.name: f for f in text_string_to_metric_families(prometheus_text(m))}
    val = lambda fam, suffix="", **labels: next(  # noqa: E731
        s.value for s in fams[fam].samples if s.name == fam + suffix and all(s.labels.get(k) == v
                                                                             for k, v in labels.items()))
    assert val("spec_hal_accepted_tokens", "_total") == 4 and val("spec_hal_draft_failures", "_total") == 1
    assert val("spec_hal_acceptance_by_position", position="2") == 0.5
    assert val("spec_hal_acceptance_length", "_bucket", le="2.0") == 1       # one step emitted 2 tokens
    assert val("spec_hal_acceptance_length", "_count") == 2
    assert val("spec_hal_time_to_first_token_seconds", "_count") == 2
    assert val("spec_hal_latency_quantile_seconds", metric="e2e_request_latency", quantile="0.99") == 1.1


def test_bounded_metrics_keep_totals_and_stop_growing():
    from hal.metrics import percentile
    m = hal.SpecDecodeMetrics().bound(3)
    for i in range(10):
        m.observe([2], [1], [f"r{i}"])
        m.first_token(f"r{i}", 0.1)
        m.finished(f"r{i}", 0.5, 3)
    assert m.total.num_draft_tokens == 20 and m.total.num_accepted_tokens == 10
    assert list(m.requests) == ["r7", "r8", "r9"] and len(m.ttft) == len(m.tpot) == len(m.e2e) == 3
    assert len(m.acceptance_lengths) == 3 and percentile(m.tpot, 50) == pytest.approx(0.2)
