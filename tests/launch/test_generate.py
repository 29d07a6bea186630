"""Draft and target as two torch.distributed ranks (gloo on 127.0.0.1), launched the
documented way (torchrun -m hal.launch): output identical to single-process plain greedy;
the draft worker killed or hung mid-run: the target finishes by plain decoding, with
identical output and the failure counted."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import hal
from hal.distributed.link import LocalLink
from hal.distributed.protocol import DRAFTS_HEAD
from hal.engine import Request, SpeculativeDecoder
from hal.engine.requests import SamplingParams
from hal.models.loaders import load_safetensors
from tests.models.test_llama import H, HEADS, KV, LAYERS, V, FFN, hf_weights

PROMPTS = ["1,2,3,4,5,6,7,8,9", "10,11,12,13,10,11,12"]
N = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from safetensors.torch import save_file
    folder = tmp_path_factory.mktemp("tiny-serve")
    save_file(hf_weights(torch.Generator().manual_seed(1)), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", tie_word_embeddings=True,
        hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        intermediate_size=FFN, vocab_size=V, rope_theta=10000.0, rms_norm_eps=1e-5)))
    return folder


def plain(folder, backend: str, prompts=PROMPTS, n=N):
    model = load_safetensors(folder, hal.get_backend(backend), "auto")   # the launcher's default
    reqs = [Request([int(t) for t in p.split(",")], max_new_tokens=n, k=0) for p in prompts]
    return SpeculativeDecoder(model, None, num_blocks=64).generate(reqs)


def serve_args(folder, out, *extra):
    args = ["--model", str(folder), "--out", str(out), "--max-tokens", str(N), "--no-route"]   # a fixed k: the faults
    #                                                                                  planted at reply N need drafts
    for p in PROMPTS:
        args += ["--prompt-ids", p]
    return args + list(extra)


def torchrun(args, env=None, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "hal.launch", *args]
    # the ranks compute at this process's thread count (torchrun would set 1): a linear plan, and a row's
    # bits, belong to a thread count, and the outputs are compared with references computed here
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    r = subprocess.run(cmd, env={**os.environ, **threads, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def test_two_ranks_draft_cpu_target_cuda_interpreter(tiny, tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 for the cuda backend on CPU")
    out = tmp_path / "o.json"
    torchrun(serve_args(tiny, out, "--draft", "self:1", "--k", "3"), {"HAL_PLACEMENT": "draft=cpu,target=cuda"})
    got = json.loads(out.read_text())
    assert got["world_size"] == 2 and got["link"] == "gloo" and got["target"].startswith("cuda")
    assert got["outputs"] == plain(tiny, "cuda"), "two-rank greedy output differs from plain greedy"
    assert got["draft_failures"] == 0 and got["acceptance_rate"] > 0
    assert got["cache_hits"] + got["cache_misses"] > 0


@pytest.mark.parametrize("push", [False, True])
def test_two_ranks_cpu_sampled_with_sparse_q(tiny, tmp_path, push):
    out = tmp_path / "o.json"
    torchrun(serve_args(tiny, out, "--draft", "self:2", "--k", "4", "--temperature", "1.0", "--top-k", "5",
                        *(["--push"] if push else [])),
             {"HAL_PLACEMENT": "draft=cpu,target=cpu"})   # push: offers over gloo, and both ranks exit 0
    got = json.loads(out.read_text())
    assert [len(o) for o in got["outputs"]] == [N, N] and all(0 <= t < V for o in got["outputs"] for t in o)
    # the draft is the target itself: with q crossing sparsely and exactly (in replies or offers), every
    # draft is accepted
    assert got["acceptance_rate"] == 1.0 and got["cache_hits"] > 0 and got["draft_failures"] == 0


def test_two_ranks_real_model(tmp_path):
    from hal.models.fetch import load_model
    try:
        target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")   # the launcher's default
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    from hal.models.tokenizer import chatml
    prompts = ["Repeat this exactly: the cat sat on the mat, the cat sat on the mat.",
               "Write a Python function that adds two numbers."]
    out = tmp_path / "o.json"
    torchrun(["--draft", "ngram", "--k", "5", "--no-route", "--max-tokens", "20", "--out", str(out)]
             + [a for p in prompts for a in ("--prompt", p)])
    got = json.loads(out.read_text())
    reqs = [Request(tok.encode(chatml(p)).ids, max_new_tokens=20, k=0, stop_ids=(target.cfg.eos_id,))
            for p in prompts]
    assert got["outputs"] == SpeculativeDecoder(target, None, num_blocks=64).generate(reqs)
    assert got["acceptance_rate"] > 0  # drafts crossed the link and were used


@pytest.mark.parametrize("push", [False, True])
def test_killed_draft_worker_target_finishes_by_plain_decoding(tiny, tmp_path, push):
    out, port = tmp_path / "o.json", str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
           "HAL_PLACEMENT": "draft=cpu,target=cpu"}
    cmd = [sys.executable, "-m", "hal.launch", *serve_args(tiny, out, "--draft", "self:2", "--k", "2",
                                                           *(["--push"] if push else []))]
    draft = subprocess.Popen(cmd, env={**env, "RANK": "1", "HAL_SERVE_FAULT": "kill:2"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    target = subprocess.run(cmd, env={**env, "RANK": "0"}, capture_output=True, text=True, timeout=300)
    draft.wait(timeout=60)
    assert draft.returncode == -9
    assert target.returncode == 0, target.stderr[-3000:]
    assert "draft worker lost" in target.stderr
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] == 1
    assert got["mean_acceptance_length"] > 1  # it did speculate before the kill


@pytest.mark.parametrize("push", [False, True])
def test_hung_draft_worker_times_out_under_torchrun(tiny, tmp_path, push):
    out = tmp_path / "o.json"
    r = torchrun(serve_args(tiny, out, "--draft", "self:2", "--k", "2", "--draft-timeout", "2",
                            *(["--push"] if push else [])),
                 {"HAL_PLACEMENT": "draft=cpu,target=cpu", "HAL_SERVE_FAULT": "hang:3:6"})
    got = json.loads(out.read_text())
    assert "Timed out" in r.stderr
    assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] == 1


def test_single_process_routed_and_planner_refusal(tiny, tmp_path):
    out = tmp_path / "o.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    pushed = subprocess.run([sys.executable, "-m", "hal.launch", *serve_args(tiny, out, "--draft", "self:2",
                                                                            "--draft-thread", "on", "--push")],
                            env={**env, "HAL_PLACEMENT": "draft=cpu,target=cpu"}, capture_output=True, text=True,
                            timeout=300)   # the draft thread with push, a fixed k: same output, and it exits 0
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu")
    # its rounds went through the worker loop (a fixed k: every round drafts, and a round's first wave of
    # branches is always drafted, so each later round is a hit or a miss whatever the timing)
    assert got["cache_hits"] + got["cache_misses"] > 0, got
    r = subprocess.run([sys.executable, "-m", "hal.launch", *serve_args(tiny, out, "--draft", "self:2", "--route",
                                                                       "--draft-thread", "on")],
                       env={**env, "HAL_PLACEMENT": "draft=cpu,target=cpu"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "max concurrent sequences x context" in r.stderr   # the plan is printed before anything is allocated
    got = json.loads(out.read_text())
    assert got["world_size"] == 1 and got["outputs"] == plain(tiny, "cpu")   # routed: k may be 0 on a busy machine
    bad = subprocess.run([sys.executable, "-m", "hal.launch", *serve_args(tiny, out, "--cpu-budget-gib", "1e-6")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "memory plan on cpu" in bad.stderr and "raise the budget" in bad.stderr
    short = subprocess.run([sys.executable, "-m", "hal.launch", *serve_args(tiny, out, "--max-context", "16")],
                           env=env, capture_output=True, text=True, timeout=300)
    assert short.returncode == 2 and "--max-context: expected at least" in short.stderr


class QueueLink(LocalLink):
    """The library's link between two threads, with a hook that rewrites sent words (planted faults)."""

    def __init__(self, inbox, outbox, tamper=None):
        super().__init__(inbox, outbox)
        self.tamper, self.n = tamper, 0

    def send(self, words, rows=None, idx=None):
        self.n += 1
        super().send(self.tamper(list(words), self.n) if self.tamper else words, rows, idx)


def in_process_two_sides(tiny, tamper=None, k=3, remote_cls=None, push=False, wait_offers=None):
    import queue
    import threading

    from hal.drafters import ModelDrafter
    from hal.metrics import SpecDecodeMetrics
    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import draft_worker
    be = hal.get_backend("cpu")
    a, b = queue.Queue(), queue.Queue()
    worker = threading.Thread(target=draft_worker, daemon=True,   # bounded=False: hits whatever the timing
                              kwargs=dict(bounded=False, push=push),
                              args=(QueueLink(a, b, tamper), ModelDrafter(load_safetensors(tiny, be))))
    worker.start()
    metrics = SpecDecodeMetrics()
    remote = (remote_cls or RemoteDrafter)(QueueLink(b, a), V, torch.device("cpu"), metrics, timeout=30, push=push,
                                           wait_offers=push if wait_offers is None else wait_offers)
    dec = SpeculativeDecoder(load_safetensors(tiny, be), remote, num_blocks=64, metrics=metrics)
    out = dec.generate([Request([int(t) for t in p.split(",")], max_new_tokens=N, k=k) for p in PROMPTS])
    remote.close()
    worker.join(timeout=30)
    return out, metrics, remote


def test_protocol_in_process_overlap_and_stale_drafts_dropped(tiny):
    out, m, remote = in_process_two_sides(tiny)
    assert out == plain(tiny, "cpu") and m.stale_drafts == 0 and remote.cache_hits > 0
    assert m.total.num_draft_tokens > 0

    def stale(words, n):  # PLANTED: every other DRAFTS reply claims a history the target never committed
        if words[0] == 2 and n % 2 == 0:
            words[DRAFTS_HEAD + 2] ^= 1  # the first request's base hash
        return words
    out, m, remote = in_process_two_sides(tiny, stale)
    assert out == plain(tiny, "cpu"), "a stale draft reached verification"
    assert m.stale_drafts > 0  # the target dropped the planted ones itself


def test_pushed_branches_answer_rounds_without_a_reply(tiny):
    """With push the worker offers its branches while the target verifies; a round whose
    every request was offered sends a COMMIT that asks for no reply. Greedy output is plain
    greedy's. PLANTED: a malformed offer is a draft failure (plain decoding from there,
    output unchanged); an offer of another round, or of another history, is never used."""
    from hal.distributed.protocol import OFFER
    out, m, remote = in_process_two_sides(tiny, push=True)
    assert out == plain(tiny, "cpu") and m.draft_failures == 0
    assert remote.pushed_rounds > 0 and m.pushed_rounds == remote.pushed_rounds and m.fanout_branches > 0

    def oov(words, n):   # PLANTED: the first offer with branches names a token outside the vocabulary
        if words[0] == OFFER and len(words) > DRAFTS_HEAD + 4 and not oov.done:
            oov.done = True
            words[DRAFTS_HEAD + 4] = 1 << 20
        return words
    oov.done = False
    out, m, remote = in_process_two_sides(tiny, oov, push=True)
    assert out == plain(tiny, "cpu") and m.draft_failures == 1 and not remote.alive

    def later(words, n):   # PLANTED: every offer claims the round after its own (the target takes what has come)
        if words[0] == OFFER:
            words[2] += 1
        return words
    out, m, remote = in_process_two_sides(tiny, later, push=True, wait_offers=False)
    assert out == plain(tiny, "cpu") and m.draft_failures == 0 and remote.pushed_rounds == 0

    def elsewhere(words, n):   # PLANTED: every offered branch names a history the target never committed
        if words[0] == OFFER:
            at = DRAFTS_HEAD
            while at < len(words):
                words[at + 2] ^= 1   # its base hash
                at += 4 + words[at + 3] + 1 + words[at + 4 + words[at + 3]]
        return words
    out, m, remote = in_process_two_sides(tiny, elsewhere, push=True)
    assert out == plain(tiny, "cpu") and m.draft_failures == 0 and remote.pushed_rounds == 0


def test_drafts_of_another_epoch_are_refused(tiny):
    """A reply stamped with an epoch other than the link's (`hal.distributed.rendezvous`) is
    refused whole: its drafts are counted stale, never verified, and drafting goes on."""
    def other_epoch(words, n):  # PLANTED: every third DRAFTS reply claims epoch 1 on epoch 0's link
        if words[0] == 2 and n % 3 == 0:
            words[1] = 1
        return words
    from tests.mutants import mutate

    def refused(remote_cls=None, tamper=other_epoch) -> int:
        out, m, remote = in_process_two_sides(tiny, tamper, remote_cls=remote_cls)
        assert out == plain(tiny, "cpu") and m.draft_failures == 0 and remote.alive
        return m.stale_drafts
    assert refused() >= 2
    assert refused(tamper=None) == 0                          # without the plant nothing is refused
    assert refused(mutate("accepts-other-epochs")) == 0       # a target that does not check takes them


class ConstantDrafter:
    """Samples every draft from ``q`` through the backend's own `sample` (the DSpark draft)."""

    def __init__(self, be, q):
        self.be, self.logq = be, q.log()

    def propose(self, batch):
        from hal.drafters.batching import sample_chain
        return sample_chain(batch, self.be, "cpu", lambda x, j: self.logq.expand(len(batch.rids), -1).contiguous())

    def commit(self, *a):
        pass

    def release(self, rid):
        pass


def remote_sampled(drafter_cls, requests=12, tokens=160, p=None, push=False, remote_cls=None):
    """The drafter one round ahead on its own thread (`hal.distributed.local.ThreadDrafter`:
    the worker protocol over the in-process link), sampling against a two-token toy target."""
    from hal.distributed.local import ThreadDrafter
    from hal.metrics import SpecDecodeMetrics
    from tests.engine.test_router import P2, Q2, ToyTarget
    be = hal.get_backend("cpu")
    metrics = SpecDecodeMetrics()
    if remote_cls is not None:   # a planted target (a mutated RemoteDrafter): the thread drafter with its methods
        planted = {name: f for name, f in vars(remote_cls).items() if callable(f) and name not in vars(ThreadDrafter)}
        ThreadDrafter = type("PlantedThreadDrafter", (ThreadDrafter,), planted)
    remote = ThreadDrafter(drafter_cls(be, Q2), 2, torch.device("cpu"), metrics,   # the whole fan-out (and with
                           bounded=False, push=push, wait_offers=push)            # push, its offers): timing-free
    dec = SpeculativeDecoder(ToyTarget(be, P2 if p is None else p), remote, num_blocks=requests * tokens // 10,
                             metrics=metrics)
    out = dec.generate([Request([0], max_new_tokens=tokens, temperature=1.0, seed=i, k=3) for i in range(requests)])
    remote.close()
    assert not remote.thread.is_alive(), "the draft thread outlived its STOP"
    return out, metrics, remote


def test_remote_sampling_with_overlap_keeps_the_target_distribution():
    """Sampled drafts from the worker, reused from the overlap guess when it holds: the emitted
    tokens and consecutive pairs still follow p (DSpark p=(0.7,0.3), q=(0.5,0.5), chi-square)."""
    from hal.conformance._helpers import assert_distribution
    from tests.engine.test_router import P2
    out, metrics, remote = remote_sampled(ConstantDrafter)
    assert remote.cache_hits > 20 and metrics.total.num_draft_tokens > 200
    assert_distribution(torch.tensor([t for o in out for t in o]), P2, "remote drafts with overlap")
    pairs = torch.tensor([x * 2 + y for o in out for x, y in zip(o, o[1:])])
    assert_distribution(pairs, torch.outer(P2, P2).flatten(), "consecutive pairs, remote drafts with overlap")


class MarkovDrafter(ConstantDrafter):
    """Samples each draft from a q that depends on the token before it (after 0: (0.9, 0.1),
    after 1: (0.1, 0.9)), so the branches of one round draft different tokens."""

    QS = torch.tensor([[0.9, 0.1], [0.1, 0.9]]).log()

    def propose(self, batch):
        from hal.drafters.batching import sample_chain
        last = batch.history[torch.arange(len(batch.rids)), batch.num_tokens - 1]
        return sample_chain(batch, self.be, "cpu", lambda x, j: self.QS[last if j == 0 else x].contiguous())


def test_remote_fanout_of_a_context_drafter_keeps_the_target_distribution(monkeypatch):
    """The worker drafts every outcome of each round ahead (`hal.distributed.speculate`) and
    answers from the branch the committed outcome selects: the emitted tokens and pairs follow
    p = (0.5, 0.5). PLANTED: a worker that selects the branch the target likes best (the most
    0s; measured P(1) 0.44) instead of the committed outcome's fails the same test."""
    from hal.conformance._helpers import assert_distribution
    from hal.distributed import speculate
    p, run = torch.tensor([0.5, 0.5]), lambda: remote_sampled(MarkovDrafter, requests=12, tokens=320, p=p)
    out, metrics, remote = run()
    assert remote.cache_hits > 0.9 * (remote.cache_hits + remote.cache_misses) and remote.cache_hits > 200
    assert metrics.fanout_branches > 2 * remote.cache_hits   # every outcome drafted, not just one guess
    assert_distribution(torch.tensor([t for o in out for t in o]), p, "remote fan-out, Markov drafts")
    pairs = torch.tensor([x * 2 + y for o in out for x, y in zip(o, o[1:])])
    assert_distribution(pairs, torch.outer(p, p).flatten(), "consecutive pairs, remote fan-out")

    honest = speculate.FanOut.lookup

    def by_target_logits(self, rid, length, h, k):   # PLANTED: the branch the target likes best (most 0s)
        s = self.specs.get(rid)
        branches = [b for b in (s.cache.values() if s is not None else ()) if len(b.drafts) >= k]
        got, planned = honest(self, rid, length, h, k)
        if got is None or not branches:
            return got, planned
        return speculate.cut(max(branches, key=lambda b: b.drafts[:k].count(0)), k), planned
    monkeypatch.setattr(speculate.FanOut, "lookup", by_target_logits)
    out, _, _ = run()
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(torch.tensor([t for o in out for t in o]), p, "branch chosen by the target's logits")


def test_pushed_fanout_keeps_the_target_distribution():
    """With push the target itself takes the offered branch of the committed outcome, with
    the q rows it was drawn from: the emitted tokens and pairs still follow p = (0.5, 0.5).
    PLANTED: a target that pairs each offered draft with another slot's q row fails the
    pairs' test. (A branch chosen by the target's liking rather than the committed outcome is
    the worker's mutant above: a target that did so here would fall out of step with the
    worker, whose next branches then miss, and is counted by ``pushed_rounds``.)"""
    from hal.conformance._helpers import assert_distribution
    from tests.mutants import mutate
    p = torch.tensor([0.5, 0.5])

    def run(remote_cls=None):
        return remote_sampled(MarkovDrafter, requests=12, tokens=320, p=p, push=True, remote_cls=remote_cls)
    out, metrics, remote = run()
    assert remote.pushed_rounds > 0.8 * remote.rounds and remote.rounds > 100
    assert_distribution(torch.tensor([t for o in out for t in o]), p, "pushed fan-out, Markov drafts")
    pairs = torch.tensor([x * 2 + y for o in out for x, y in zip(o, o[1:])])
    assert_distribution(pairs, torch.outer(p, p).flatten(), "consecutive pairs, pushed fan-out")
    out, _, remote = run(mutate("offered-rows-shifted"))   # measured: pairs 0.32 / 0.19 / 0.19 / 0.30
    assert remote.pushed_rounds > 0.8 * remote.rounds
    pairs = torch.tensor([x * 2 + y for o in out for x, y in zip(o, o[1:])])
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(pairs, torch.outer(p, p).flatten(), "offered drafts with another slot's rows")


class PeekingConstantDrafter(ConstantDrafter):
    """PLANTED: the worker keeps drafts only up to the first token 1 (looks before choosing k)."""

    def propose(self, batch):
        prop = super().propose(batch)
        ids, cu = prop.draft_token_ids.tolist(), prop.cu_num_draft_tokens.tolist()
        keep = tuple(d.index(1) if 1 in d else len(d) for d in (ids[a:b] for a, b in zip(cu, cu[1:])))
        return dataclasses.replace(prop, num_valid=torch.tensor(keep))


def test_planted_peeking_worker_is_caught():
    from hal.conformance._helpers import assert_distribution
    from tests.engine.test_router import P2
    out, _, _ = remote_sampled(PeekingConstantDrafter)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(torch.tensor([t for o in out for t in o]), P2, "peeking worker")


# -- the target trusts nothing the worker sends (issue "Hardening", items 3 and 4) ----------------

def _bad_reply(how):
    from hal.distributed.protocol import DRAFTS, corrupted

    def tamper(words, n):   # PLANTED: the second DRAFTS reply is malformed
        return corrupted(words, how) if words[0] == DRAFTS and n == 2 else words
    return tamper


@pytest.mark.parametrize("how", ["kind", "truncated", "oov", "negative", "count"])
def test_malformed_reply_is_a_draft_failure(tiny, how):
    """Out-of-vocab or negative draft ids, a truncated reply, a wrong message kind or an absurd
    count: the target validates, counts a draft failure and finishes by plain decoding."""
    out, m, remote = in_process_two_sides(tiny, _bad_reply(how))
    assert out == plain(tiny, "cpu"), f"a {how} reply changed the output"
    assert m.draft_failures == 1 and not remote.alive and not remote.lost
    assert m.total.num_draft_tokens > 0          # it speculated before the bad reply


def test_malformed_reply_over_the_link(tiny, tmp_path):
    """The same through torchrun and gloo: the worker is told to STOP and both ranks exit."""
    out = tmp_path / "o.json"
    torchrun(serve_args(tiny, out, "--draft", "self:2", "--k", "2"),
             {"HAL_PLACEMENT": "draft=cpu,target=cpu", "HAL_SERVE_FAULT": "bad:1:oov"})
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] == 1


def test_worker_that_never_joins(tiny, tmp_path):
    """No draft rank at all (it died before the rendezvous): the target waits
    --draft-startup-timeout, then serves alone."""
    import time
    out = tmp_path / "o.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "RANK": "0", "HAL_PLACEMENT": "draft=cpu,target=cpu"}
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hal.launch", *serve_args(tiny, out, "--draft", "self:2",
                                                                       "--draft-startup-timeout", "3")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "did not join" in r.stderr and time.monotonic() - t < 90
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] == 1


def test_a_worker_that_joins_late_is_taken_in_by_the_next_epoch(tiny):
    """The real rendezvous (a TCP store on 127.0.0.1, gloo groups), the target and the worker
    in two threads: nobody joined epoch 0, so the target decodes plainly with epoch 1 open;
    a worker that starts mid-generation joins it, the target takes it in at its next step and
    drafting resumes. The output is plain greedy's; one rejoin is counted; STOP ends the worker."""
    import threading
    import time

    from hal.drafters import NgramDrafter
    from hal.distributed.rendezvous import Rendezvous
    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import serve_epochs
    from hal.metrics import SpecDecodeMetrics
    be, port = hal.get_backend("cpu"), free_port()
    rv = Rendezvous(0, "gloo", 10.0, "127.0.0.1", port)
    metrics = SpecDecodeMetrics()
    remote = RemoteDrafter(None, V, torch.device("cpu"), metrics, timeout=10, rendezvous=rv)
    assert remote.epoch == 1 and not remote.alive
    dec = SpeculativeDecoder(load_safetensors(tiny, be), remote, num_blocks=64, metrics=metrics)
    rids = [dec.add_request([int(t) for t in p.split(",")], SamplingParams(max_new_tokens=N, k=3)) for p in PROMPTS]
    out = {r: [] for r in rids}
    for _ in range(3):   # plain steps: nobody is there yet
        for r, t in dec.step().tokens.items():
            out[r] += t
    assert metrics.total.num_draft_tokens == 0
    worker = threading.Thread(target=serve_epochs, daemon=True,
                              args=(Rendezvous(1, "gloo", 10.0, "127.0.0.1", port), NgramDrafter(be),
                                    torch.device("cpu")))
    worker.start()
    deadline = time.monotonic() + 60
    while not rv.joining(1):   # a condition, bounded
        assert time.monotonic() < deadline, "the worker did not say it joins epoch 1"
        time.sleep(0.01)
    while dec.has_unfinished():
        for r, t in dec.step().tokens.items():
            out[r] += t
    remote.close()
    worker.join(30)
    assert [out[r] for r in rids] == plain(tiny, "cpu")
    assert metrics.workers_rejoined == 1 and remote.alive and metrics.total.num_draft_tokens > 0
    assert not worker.is_alive()   # it returned at STOP


def test_worker_that_stops_before_its_first_reply(tiny, tmp_path):
    out = tmp_path / "o.json"
    torchrun(serve_args(tiny, out, "--draft", "self:2", "--k", "2", "--draft-startup-timeout", "3"),
             {"HAL_PLACEMENT": "draft=cpu,target=cpu", "HAL_SERVE_FAULT": "hang:0:6"})
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] >= 1
    # it never speculated, unless the worker rejoined by the next epoch before its hang ended (it joins the
    # epoch the target announces on giving up, 3 s in, and exits at 6 s: on a busy machine the run lasts that
    # long); then that worker's loss may count once more
    if got["workers_rejoined"] == 0:
        assert got["mean_acceptance_length"] in (0, 1.0) and got["draft_failures"] == 1, got
    assert got["draft_failures"] <= 2, got


def _wait(cond, what: str, timeout: float = 60.0) -> float:
    """Wait (bounded) for ``cond``; the seconds it took."""
    import time
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.01)
    return time.monotonic() - t0


def test_a_worker_waits_for_a_target_that_loads_past_the_old_bound(tiny):
    """The outside trial: the target's first linear plan took 88 s, the worker gave up after
    its 60 s bound and the server never answered. The bound now starts when the target is
    ready to meet (it announces epoch 0 after its plan and load): a worker with a 2 s bound
    waits out a target that takes 4 s to get ready, joins epoch 0 and drafts; the output is
    plain greedy's."""
    import threading
    import time

    from hal.drafters import NgramDrafter
    from hal.distributed.link import Link
    from hal.distributed.protocol import DRAFT
    from hal.distributed.rendezvous import Rendezvous
    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import serve_epochs
    from hal.metrics import SpecDecodeMetrics
    be, port = hal.get_backend("cpu"), free_port()
    rv = Rendezvous(0, "gloo", 2.0, "127.0.0.1", port)
    failed = []

    def work():
        try:
            serve_epochs(Rendezvous(1, "gloo", 2.0, "127.0.0.1", port), NgramDrafter(be), torch.device("cpu"),
                         idle=60.0, join_timeout=10.0)
        except Exception as e:  # noqa: BLE001 (reported below)
            failed.append(e)
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    model = load_safetensors(tiny, be)
    time.sleep(4.0)   # the target's plan and load, past the worker's 2 s bound (what is tested is this delay)
    assert worker.is_alive() and not failed, failed
    rv.announce(0)
    link = Link(DRAFT, torch.device("cpu"), rv.group(0, 10.0), framed=True)
    metrics = SpecDecodeMetrics()
    remote = RemoteDrafter(link, V, torch.device("cpu"), metrics, timeout=10, rendezvous=rv)
    dec = SpeculativeDecoder(model, remote, num_blocks=64, metrics=metrics)
    outs = dec.generate([Request([int(t) for t in p.split(",")], max_new_tokens=N, k=3) for p in PROMPTS])
    remote.close()
    worker.join(30)
    assert outs == plain(tiny, "cpu") and metrics.total.num_draft_tokens > 0 and not failed, failed


def test_an_idle_server_takes_back_a_fresh_worker_within_2_s(tiny):
    """The outside trial: a fresh worker did not rejoin an idle server (``/health`` stayed
    degraded for 300 s, and the first request then paid for a failed epoch). The engine loop
    now calls the target's ``on_idle`` while nothing runs: a worker that says it joins is
    taken back within 2 s, without any request."""
    import threading

    from hal.launch.start import Target
    from hal.drafters import NgramDrafter
    from hal.distributed.rendezvous import Rendezvous
    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import serve_epochs
    from hal.metrics import SpecDecodeMetrics
    from hal.server.engine_loop import EngineLoop
    be, port = hal.get_backend("cpu"), free_port()
    rv = Rendezvous(0, "gloo", 10.0, "127.0.0.1", port)
    metrics = SpecDecodeMetrics()
    remote = RemoteDrafter(None, V, torch.device("cpu"), metrics, timeout=10, rendezvous=rv)   # nobody joined
    dec = SpeculativeDecoder(load_safetensors(tiny, be), remote, num_blocks=64, metrics=metrics)
    target = Target(dec, None, 2, "gloo", None)
    loop = EngineLoop(dec, on_idle=target.on_idle)
    loop.start()
    assert target.degraded is not None
    worker = threading.Thread(target=serve_epochs, daemon=True,
                              args=(Rendezvous(1, "gloo", 10.0, "127.0.0.1", port), NgramDrafter(be),
                                    torch.device("cpu")))
    worker.start()
    try:
        _wait(lambda: rv.joining(remote.epoch), "the worker did not say it joins")
        took = _wait(lambda: remote.alive, "the idle server did not take the worker back", timeout=30)
        print(f"taken back {took:.2f} s after the worker said it joins")
        assert took < 10.0 and metrics.workers_rejoined == 1 and target.degraded is None, took   # (0.1 s here)
        assert dec.steps == 0   # no request was needed
    finally:
        loop.stop()
        remote.close()
        worker.join(30)
    assert not worker.is_alive()
