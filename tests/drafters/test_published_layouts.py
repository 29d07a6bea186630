"""Published drafter checkpoints draft as their authors' code drafts them.

The fixtures under ``tests/fixtures/drafters/`` were written by ``scripts/oracles/*_reference.py``,
which run the authors' own code (z-lab/dflash, deepseek-ai/DeepSpec, SafeAILab/EAGLE; the commits
are named in each script) on tiny random models: a transformers Qwen3 or Llama target, a drafter
in the published layout, and the reference's drafts, draft logits and confidences at every step
of its own decoding loop. Here spec-hal loads the same folders and drafts from the same prefixes.

Tolerance: both sides run float32; the draft log-probabilities agree within 1e-4 (measured: at
most 3e-6), drafted tokens exactly, confidences within 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hal
from hal import kv
from hal.drafters.dflash import DFlashDrafter
from hal.drafters.dspark import DSparkDrafter
from hal.drafters.eagle import EagleDrafter
from hal.engine.forward import forward_tokens
from hal.models.block_layouts import load_block
from hal.models.eagle_layouts import head_feature_layers, load_eagle
from hal.models.fetch import load_model
from tests.drafters.test_dspark import view

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "drafters"
TOL = 1e-4


@pytest.fixture(scope="module")
def targets():
    be = hal.get_backend("cpu")
    return {kind: load_model(str(FIX / kind / "tiny_target"), be)[0] for kind in ("dflash", "dspark", "eagle3")}


def reference(kind: str) -> dict:
    return torch.load(FIX / kind / "ref_out.pt", weights_only=True)


def features(target, ids: list[int], taps) -> torch.Tensor:
    """The target's features of every position of ``ids`` at ``taps`` (layer inputs)."""
    c = target.cfg
    pool = kv.KVPool(target.be, 8, 16, c.kv_heads, c.head_dim, num_layers=c.layers)
    rows = torch.arange(len(ids))
    return forward_tokens(target, pool, [pool.sequence()], [len(ids)], torch.tensor(ids), rows=rows[-1:],
                          hidden_rows=rows, feature_layers=taps)[1]


def block_step(model, target, ids: list[int], P: int, temperature=0.0):
    """A fresh block drafter's proposal for the prefix ``ids[:P + 1]`` (the anchor at P)."""
    drafter = DSparkDrafter(model)
    f = features(target, ids[:P + 1], model.cfg.taps)
    return drafter, drafter.propose(view(ids[:P + 1], P + 1, f[:P], k=model.proposals, temperature=temperature))


@pytest.mark.parametrize("loop", ["loop", "loop_forced"])
def test_dflash_drafts_equal_z_labs_reference(targets, loop):
    """Every step of z-lab's ``dflash_generate`` (and a run whose acceptances were forced, so the
    context grows by several rows a step): the same greedy block, the same draft distribution."""
    target, ref = targets["dflash"], reference("dflash")
    model = load_block(FIX / "dflash" / "tiny_dflash", target)
    assert model.cfg.taps == tuple(i + 1 for i in ref["meta"]["target_layer_ids"]) and model.proposals == 7
    ids = ref[loop]["output_ids"][0].tolist()
    for step in ref[loop]["steps"]:
        P = int(step["start"])
        _, p = block_step(model, target, ids, P)
        assert p.draft_token_ids.tolist() == step["draft_tokens"].reshape(-1).tolist()
        _, p = block_step(model, target, ids, P, temperature=1.0)   # no Markov link: q is softmax(row)
        want = torch.log_softmax(step["draft_logits"].reshape(7, -1).float(), -1)
        assert (p.draft_probs[:7].log() - want).abs().max() < TOL


def test_dspark_drafts_and_confidences_equal_deepspecs_reference(targets):
    """DeepSpec's DSpark: the anchor's row proposes too (7 proposals from a block of 7), the
    Markov head chains them left to right, the confidence head reads [h, markov_w1[prev]]."""
    target, ref = targets["dspark"], reference("dspark")
    model = load_block(FIX / "dspark" / "tiny_dspark", target)
    assert model.proposals == 7 and model.cfg.rank == ref["meta"]["markov_rank"]
    greedy = ref["greedy_loop"]
    ids = greedy["output_ids"][0].tolist()
    for rnd in greedy["rounds"]:
        drafter, p = block_step(model, target, ids, int(rnd["start"]))
        assert p.draft_token_ids.tolist() == rnd["draft_tokens"].reshape(-1).tolist()
        torch.testing.assert_close(torch.tensor(drafter.confidences[0]),
                                   torch.sigmoid(rnd["confidence_logits"].reshape(-1).float()), atol=1e-5, rtol=0)
    first = ref["draft_logits"].reshape(7, -1)
    _, p = block_step(model, target, ref["prompt_ids"][0].tolist() + [int(ref["anchor_token"])],
                      int(ref["anchor_position"]), temperature=1.0)
    # the sampled chain's first row reads only the anchor: DeepSpec's first row, as logged
    assert (p.draft_probs[0].log() - torch.log_softmax(first[0].float(), -1)).abs().max() < TOL


def test_sampled_dspark_rows_follow_the_drawn_tokens(targets):
    """Sampled rounds of DeepSpec's loop: each row is the reference's base row plus the Markov
    bias of the token the drafter itself drew before it (``w1[prev] @ w2.T``, the checkpoint's
    tensors), so q is exactly the row each token was drawn from."""
    from safetensors.torch import load_file
    target, ref = targets["dspark"], reference("dspark")
    model = load_block(FIX / "dspark" / "tiny_dspark", target)
    w = load_file(str(FIX / "dspark" / "tiny_dspark" / "model.safetensors"))
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    loop = ref["sampled_loop"]
    ids = loop["output_ids"][0].tolist()
    for rnd in loop["rounds"]:
        toks = rnd["draft_tokens"].reshape(-1).tolist()
        base = rnd["draft_logits"].reshape(7, -1) - w1[torch.tensor([int(rnd["anchor"])] + toks[:-1])] @ w2.T
        _, p = block_step(model, target, ids, int(rnd["start"]), temperature=1.0)
        drawn = p.draft_token_ids.tolist()
        want = torch.log_softmax(base + w1[torch.tensor([int(rnd["anchor"])] + drawn[:-1])] @ w2.T, -1)
        assert (p.draft_probs[:7].log() - want).abs().max() < TOL


def test_eagle3_original_layout_chain_equals_safeailabs_reference(targets):
    """SafeAILab's EAGLE-3 head (fp16 pytorch_model.bin, no RoPE keys: base 10000 under a target
    of 500000): the features enter layers (2, L//2, L-3) and the greedy chain is the reference's."""
    target, ref = targets["eagle3"], reference("eagle3")
    folder = FIX / "eagle3" / "tiny_head"
    head = load_eagle(folder, target)
    L = target.cfg.layers
    assert head.feature_layers == (2, L // 2, L - 3) == head_feature_layers(folder, L)   # read from .bin names too
    assert head.cfg.rope_base == 10000.0 and target.cfg.rope_base != 10000.0
    ids = ref["prompt_ids"].tolist() + [int(ref["target_next_token"])]
    f = features(target, ids, head.feature_layers)
    assert (f[:-1] - ref["aux_hidden"]).abs().max() < TOL
    n = len(ref["draft_tokens"])
    p = EagleDrafter(head).propose(view(ids, len(ids), f[:-1], k=n))
    assert p.draft_token_ids.tolist() == ref["draft_tokens"].tolist()
    p = EagleDrafter(head).propose(view(ids, len(ids), f[:-1], k=1, temperature=1.0))
    want = torch.log_softmax(ref["draft_logits_full"][0].float(), -1)
    seen = torch.isfinite(want)
    assert (p.draft_probs[0][seen].log() - want[seen]).abs().max() < TOL and (p.draft_probs[0][~seen] == 0).all()


def drafter_for(kind: str, target, tmp_path):
    """The fixture drafter of ``kind`` for ``target`` (either fixture family: every fixture has
    hidden 64 and vocabulary 256). The EAGLE-3 head on a target too shallow for its default
    taps gets vLLM's top-level ids (layer inputs) in a copy of its config."""
    import json
    import shutil
    if kind == "eagle3":
        folder = FIX / "eagle3" / "tiny_head"
        L = target.cfg.layers
        if len({2, L // 2, L - 3}) < 3:
            folder = Path(shutil.copytree(folder, tmp_path / "head"))
            c = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**c, "eagle_aux_hidden_state_layer_ids": [1, 3, L - 1]}))
        return EagleDrafter(load_eagle(folder, target))
    return DSparkDrafter(load_block(FIX / kind / f"tiny_{kind}", target))


@pytest.mark.parametrize("family", ["dflash", "eagle3"])   # whose fixture target: Qwen3, Llama
@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
def test_greedy_output_with_each_published_drafter_equals_plain_greedy(targets, kind, family, tmp_path):
    from hal.engine import SpeculativeDecoder
    from hal.engine.requests import Request
    target = targets[family]
    prompts = [[3, 17, 42, 99, 5, 123, 7], [200, 31, 64], list(range(1, 60, 3)), [9]]
    plain = SpeculativeDecoder(target, None).generate([Request(p, max_new_tokens=24, k=0) for p in prompts])
    dec = SpeculativeDecoder(target, drafter_for(kind, target, tmp_path), max_num_batched_tokens=16, max_num_seqs=4)
    assert dec.generate([Request(p, max_new_tokens=24, k=4) for p in prompts]) == plain
    assert dec.metrics.total.num_draft_tokens > 0


class UniformFirstQ(DSparkDrafter):
    """A planted mutant: each block's first proposal reports a uniform q, not the row (base plus
    Markov bias) it was drawn from."""

    def propose(self, batch):
        from dataclasses import replace
        p = super().propose(batch)
        if p.draft_probs is None:
            return p
        q, cu = p.draft_probs.clone(), p.cu_num_draft_tokens.tolist()
        for i in range(len(batch.rids)):
            if cu[i + 1] > cu[i]:
                q[cu[i]] = 1.0 / q.shape[1]
        return replace(p, draft_probs=q)


def test_sampled_output_with_deepspecs_dspark_keeps_the_target_law_and_a_wrong_q_does_not(targets):
    """The second generated token (the first one a block proposes) over 1500 seeds at temperature
    0.7: with the published DSpark drafter it follows plain sampling's law (chi-square p > 1e-3);
    with a q that is not the drawn row it does not (p < 1e-4; measured 7e-9)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    from hal.engine import SpeculativeDecoder
    from hal.engine.requests import Request
    target = targets["dspark"]
    model = load_block(FIX / "dspark" / "tiny_dspark", target)

    def law(drafter):
        dec = SpeculativeDecoder(target, drafter, num_blocks=1024, max_num_seqs=64)
        outs = dec.generate([Request([3, 17, 42, 99, 5], max_new_tokens=4, k=0 if drafter is None else 4, seed=s,
                                     temperature=0.7) for s in range(1500)])
        return Counter(o[1] for o in outs), dec

    def p_value(a, b):
        keys = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]   # rare tokens pooled into one cell
        rows = [[c[t] for t in keys] + [sum(v for t, v in c.items() if t not in keys)] for c in (a, b)]
        return chi2_contingency([[x + 0.5 for x in r] for r in rows])[1]
    plain, _ = law(None)
    spec, dec = law(DSparkDrafter(model))
    assert dec.metrics.total.num_accepted_tokens > 500
    assert p_value(plain, spec) > 1e-3
    assert p_value(plain, law(UniformFirstQ(model))[0]) < 1e-4


def speculators_copy(tmp_path, **flags) -> Path:
    """The fixture head as speculators' converter writes it (its eagle3_converter renames
    ``midlayer.`` to ``layers.0.`` and nests the model config in ``transformer_layer_config``)."""
    import json

    from safetensors.torch import save_file
    src = FIX / "eagle3" / "tiny_head"
    c = json.loads((src / "config.json").read_text())
    w = torch.load(src / "pytorch_model.bin", weights_only=True)
    out = tmp_path / "speculators"
    out.mkdir(parents=True)
    save_file({n.replace("midlayer.", "layers.0."): t.contiguous() for n, t in w.items()}, str(out / "model.safetensors"))
    top = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "draft_vocab_size": c["draft_vocab_size"], "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
           "transformer_layer_config": {k: v for k, v in c.items() if k != "architectures"}, **flags}
    (out / "config.json").write_text(json.dumps(top))
    return out


def test_the_speculators_layout_drafts_as_the_original(targets, tmp_path):
    """Same tensors, speculators' names and config: the same chain as SafeAILab's; its
    ``norm_before_residual`` is read (true where the key is missing, as vLLM reads it)."""
    target, ref = targets["eagle3"], reference("eagle3")
    ids = ref["prompt_ids"].tolist() + [int(ref["target_next_token"])]
    head = load_eagle(speculators_copy(tmp_path, norm_before_residual=False), target)
    assert head.feature_layers == (2, 4, 5) and not head.cfg.norm_before_residual
    f = features(target, ids, head.feature_layers)
    p = EagleDrafter(head).propose(view(ids, len(ids), f[:-1], k=len(ref["draft_tokens"])))
    assert p.draft_token_ids.tolist() == ref["draft_tokens"].tolist()
    other = load_eagle(speculators_copy(tmp_path / "x"), target)
    assert other.cfg.norm_before_residual
    q = EagleDrafter(other).propose(view(ids, len(ids), f[:-1], k=1, temperature=1.0)).draft_probs[0]
    want = torch.softmax(ref["draft_logits_full"][0].float(), -1)
    assert (q - want).abs().max() > 1e-3   # the residual is the normed feature: another head


def edited(tmp_path, kind: str, name: str, **config) -> Path:
    import json
    import shutil
    folder = Path(shutil.copytree(FIX / kind / name, tmp_path / name))
    c = json.loads((folder / "config.json").read_text())
    for key, value in config.items():
        if isinstance(c.get("dflash_config"), dict) and key in c["dflash_config"]:
            c["dflash_config"][key] = value
        else:
            c[key] = value
    (folder / "config.json").write_text(json.dumps(c))
    return folder


@pytest.mark.parametrize("kind,name,config,field", [
    ("dflash", "tiny_dflash", {"mask_token_id": 256}, "mask_token_id"),
    ("dflash", "tiny_dflash", {"target_layer_ids": [0, 2, 6]}, "target_layer_ids"),
    ("dflash", "tiny_dflash", {"hidden_size": 32}, "hidden"),
    ("dflash", "tiny_dflash", {"vocab_size": 300}, "vocab_size"),
    ("dflash", "tiny_dflash", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("dflash", "tiny_dflash", {"architectures": ["DFlashV9"]}, "architectures"),
    ("dspark", "tiny_dspark", {"markov_head_type": "rnn"}, "markov_head_type"),
    ("dspark", "tiny_dspark", {"markov_rank": 4}, "markov_w1"),
    ("dspark", "tiny_dspark", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope"),
    ("eagle3", "tiny_head", {"num_hidden_layers": 2}, "num_hidden_layers"),
    ("eagle3", "tiny_head", {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, "eagle_aux_hidden_state_layer_ids"),
])
def test_a_checkpoint_that_does_not_fit_its_target_is_refused_by_field(targets, tmp_path, kind, name, config, field):
    target = targets[kind]
    folder = edited(tmp_path, kind, name, **config)
    with pytest.raises(hal.HalError, match=field):
        (load_eagle if kind == "eagle3" else load_block)(folder, target)


def test_a_tensor_no_layer_reads_is_refused_not_dropped(targets, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    folder = Path(shutil.copytree(FIX / "dflash" / "tiny_dflash", tmp_path / "d"))
    w = load_file(str(folder / "model.safetensors"))
    save_file({**w, "layers.0.self_attn.q_proj.bias": torch.zeros(128)}, str(folder / "model.safetensors"))
    with pytest.raises(hal.HalError, match="q_proj.bias"):
        load_block(folder, targets["dflash"])
    head = speculators_copy(tmp_path)
    w = load_file(str(head / "model.safetensors"))
    save_file({**w, "fc_norm.0.weight": torch.ones(64)}, str(head / "model.safetensors"))
    with pytest.raises(hal.HalError, match="fc_norm"):
        load_eagle(head, targets["eagle3"])


def test_draft_flags_name_published_folders(targets):
    """``--draft dflash:<folder>`` and ``dspark:<folder>`` read either published block layout,
    ``eagle:<folder>`` either EAGLE-3 layout; a target rank reads their taps without weights."""
    from hal.drafters.kinds import feature_layers, make_drafter, parse_draft
    be = hal.get_backend("cpu")
    for flag, kind in (("dflash", "dflash"), ("dspark", "dspark"), ("dflash", "dspark")):
        spec = parse_draft(f"{flag}:{FIX / kind / f'tiny_{kind}'}")
        drafter = make_drafter(spec, be, targets[kind])
        assert isinstance(drafter, DFlashDrafter if kind == "dflash" else DSparkDrafter)
        assert type(drafter) is DFlashDrafter or kind == "dspark"
        assert drafter.features == feature_layers(spec, "", 6)
    spec = parse_draft(f"eagle:{FIX / 'eagle3' / 'tiny_head'}")
    assert isinstance(make_drafter(spec, be, targets["eagle3"]), EagleDrafter)
    assert feature_layers(spec, "", 8) == (2, 4, 5)
    with pytest.raises(hal.HalError, match="--draft"):
        parse_draft("dflash")


def test_deepspecs_confidences_schedule_the_verify_length(targets):
    """With a routed engine's cost table, the verified prefix of a DSpark block is
    `confidence_cut` of the published head's confidences (prefix survival against the measured
    cost per fed token); a DFlash block, having no confidences, offers every proposal."""
    from hal.drafters.dspark import confidence_cut
    from tests.drafters.test_dspark import COSTS
    ref = reference("dspark")
    for kind in ("dspark", "dflash"):
        target = targets[kind]
        drafter = DSparkDrafter(load_block(FIX / kind / f"tiny_{kind}", target))
        ids = ref["prompt_ids"][0].tolist() + [int(ref["anchor_token"])]
        f = features(target, ids, drafter.model.cfg.taps)
        k = drafter.model.proposals
        p = drafter.propose(view(ids, len(ids), f[:-1], k=k, costs=COSTS))
        if kind == "dspark":
            c = drafter.confidences[0]
            assert p.num_valid.tolist() == confidence_cut([c], (k,), [len(ids)], COSTS) and len(c) == k
        else:
            assert p.num_valid.tolist() == [k] and drafter.confidences == {}


def test_a_mixed_drafters_rows_are_counted_under_the_method_that_drafted_them(targets):
    """n-gram lookup where it matches, the EAGLE-3 head elsewhere: the per-method counters
    split the step's rows, and together they are the totals."""
    from hal.drafters import NgramDrafter
    from hal.drafters.eagle import NgramOrHead
    from hal.engine import SpeculativeDecoder
    from hal.engine.requests import Request
    target = targets["eagle3"]
    mixed = NgramOrHead(NgramDrafter(target.be, min_n=2), EagleDrafter(load_eagle(FIX / "eagle3" / "tiny_head",
                                                                                  target)))
    assert mixed.kind == "ngram+eagle3"
    dec = SpeculativeDecoder(target, mixed, max_num_seqs=4)
    dec.generate([Request([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=16, k=3),
                  Request([200, 31, 64, 9], max_new_tokens=16, k=3)])
    by = dec.metrics.by_drafter
    assert set(by) == {"ngram", "eagle3"}, by
    assert sum(c.num_drafts for c in by.values()) == dec.metrics.total.num_drafts
    assert sum(c.num_accepted_tokens for c in by.values()) == dec.metrics.total.num_accepted_tokens


def test_a_dspark_checkpoint_without_its_copies_borrows_the_targets(targets, tmp_path):
    """DeepSpec's checkpoints carry copies of the target's embeddings and lm_head. Without them
    (`without_copies`: the shipped drafter's form) the target's own are read, and the drafts and
    confidences are the same; `with_copies` writes them back as they were. One copy alone, or
    copies that are not the target's, are refused."""
    from safetensors.torch import load_file, save_file

    from hal.models.block_layouts import with_copies, without_copies
    target, ref = targets["dspark"], reference("dspark")
    src = FIX / "dspark" / "tiny_dspark"
    without_copies(src, tmp_path / "bare", target)
    bare = load_file(str(tmp_path / "bare" / "model.safetensors"))
    assert "embed_tokens.weight" not in bare and "lm_head.weight" not in bare
    ids, start = ref["greedy_loop"]["output_ids"][0].tolist(), int(ref["greedy_loop"]["rounds"][0]["start"])
    got = [block_step(load_block(f, target), target, ids, start) for f in (src, tmp_path / "bare")]
    assert got[0][1].draft_token_ids.tolist() == got[1][1].draft_token_ids.tolist()
    assert got[0][0].confidences == got[1][0].confidences
    with_copies(tmp_path / "bare", tmp_path / "whole", target)
    whole, orig = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert set(whole) == set(orig) and all(torch.equal(whole[n], orig[n]) for n in orig)
    save_file({**bare, "lm_head.weight": orig["lm_head.weight"]}, str(tmp_path / "bare" / "model.safetensors"))
    with pytest.raises(hal.HalError, match="expected both embed_tokens and lm_head .* got only lm_head"):
        load_block(tmp_path / "bare", target)
    odd = {**orig, "lm_head.weight": orig["lm_head.weight"] + 1}
    save_file(odd, str(tmp_path / "bare" / "model.safetensors"))
    with pytest.raises(hal.HalError, match="lm_head.weight: expected a copy of the target's, got other values"):
        without_copies(tmp_path / "bare", tmp_path / "again", target)
    assert not (tmp_path / "again").exists()
