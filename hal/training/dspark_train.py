"""``spec-hal train-head --kind dspark``: train a block drafter (`hal.models.dspark`) by
self-distillation on the target's own greedy continuations (`hal.training.block_data`).

Each step takes a few sequences and, in each, random anchors in the response: block n is
``[token at a_n, mask x (B - 1)]`` and sees the context features of positions ``< a_n`` and its own
block (the DFlash training mask). Losses, per proposed position j = 1 .. B - 1:
- cross-entropy of ``base + Markov(previous true token)`` against the target's token, weighted
  ``exp(-(j - 1) / DECAY)`` (later positions count less: they are verified only after the earlier);
  with ``distill`` > 0, that share of it is against the target's whole next-token distribution
  instead (its softmax over the draft vocabulary, from the recorded last-layer output through the
  target's final norm and lm_head rows: the soft labels EAGLE's head trains on);
- the confidence head's binary cross-entropy against "this row's argmax is the target's token"
  (inputs detached, so it never pulls the drafter toward easy positions).

The same maths as `hal.models.dspark.DSparkModel` (dense SDPA with a mask instead of the paged
cache; `tests/models/test_dspark.py` checks the two agree)."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models.dspark import Confidence, DSparkConfig
from hal.training.block_data import BlockData, block_targets, to_draft_of

DECAY = 4.0   # position j's loss weight exp(-(j - 1) / DECAY)
LAYOUTS = {"dspark": "Qwen3DSparkModel", "dflash": "DFlashDraftModel"}   # --layout: the architectures of
#   `hal.models.block_layouts` (DSPARK, DFLASH) train-head writes


class DSparkTrain(torch.nn.Module):
    """A block drafter's parameters (internal names, `DSparkConfig.shapes`) and its training forward."""

    def __init__(self, cfg: DSparkConfig, embed: Tensor, head: Tensor, draft_ids: Tensor, mask_token: int,
                 seed: int = 0, final_norm: Tensor | None = None):
        """``mask_token``: the mask rows are that token's embedding, frozen."""
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.p = torch.nn.ParameterDict()
        for name, shape in cfg.shapes(embed.shape[0]).items():
            if name.endswith("norm"):
                t = torch.ones(shape)
            elif name in ("conf", "conf_bias"):
                t = torch.zeros(shape)
            elif name == "mask":
                t = embed[mask_token].float().clone()
            else:
                t = torch.randn(shape, generator=g) * 0.02
            self.p[name.replace(".", "_")] = torch.nn.Parameter(t, requires_grad=name != "mask")
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("head", head.float()[draft_ids].contiguous(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        self.final_norm = None if final_norm is None else final_norm.float()
        from hal.models.rope import Rope
        self.rope = Rope(cfg.head_dim, cfg.rope_base, False)

    def w(self, name: str) -> Tensor:
        return self.p[name.replace(".", "_")]

    def weights(self) -> dict[str, Tensor]:
        shapes = self.cfg.shapes(len(self.embed))
        return {name: self.w(name).detach() for name in shapes} | {"draft_ids": self.draft_ids}

    def forward(self, feats: Tensor, ids: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """feats [S, T, len(taps) * H], ids [S, T], anchors [S, N] (positions) -> base logits
        [S, N, P, Vd] and hidden states [S, N, P, H] of the P = `DSparkConfig.proposals` rows."""
        c = self.cfg
        S, T = ids.shape
        N, B, D = anchors.shape[1], c.block, c.head_dim
        nq, nk = c.heads * D, c.kv_heads * D
        ctx = F.rms_norm(feats @ self.w("fc").T, (c.hidden,), self.w("hidden_norm"), c.eps)
        first = self.embed[ids.gather(1, anchors)]                                       # [S, N, H]
        h = torch.cat([first[:, :, None], self.w("mask").expand(S, N, B - 1, c.hidden)], 2).reshape(S, N * B, -1)
        pos_blk = (anchors[:, :, None] + torch.arange(B)).reshape(S, N * B)
        rot_blk = self.rope(pos_blk.reshape(-1))
        rot_ctx = self.rope(torch.arange(T).repeat(S))
        block_of = torch.arange(N).repeat_interleave(B)
        see_ctx = torch.arange(T)[None, None] < anchors.repeat_interleave(B, 1)[:, :, None]   # [S, NB, T]
        see_blk = (block_of[:, None] == block_of[None]).expand(S, N * B, N * B)
        mask = torch.cat([see_ctx, see_blk], 2)[:, None]
        for i in range(c.layers):
            x = F.rms_norm(h, (c.hidden,), self.w(f"{i}.attn_norm"), c.eps)
            qkv = x @ self.w(f"{i}.wqkv").T
            kv = ctx @ self.w(f"{i}.wqkv")[nq:].T
            rope = lambda t, rot, n: self.rope.apply(t.reshape(-1, n, D), rot).view(S, -1, n, D)  # noqa: E731
            q = rope(self.qk_norm(qkv[..., :nq], i, "q"), rot_blk, c.heads)
            k = torch.cat([rope(self.qk_norm(kv[..., :nk], i, "k"), rot_ctx, c.kv_heads),
                           rope(self.qk_norm(qkv[..., nq:nq + nk], i, "k"), rot_blk, c.kv_heads)], 1)
            v = torch.cat([kv[..., nk:], qkv[..., nq + nk:]], 1).view(S, -1, c.kv_heads, D)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True)
            h = h + o.transpose(1, 2).reshape(S, N * B, nq) @ self.w(f"{i}.wo").T
            gate, up = (F.rms_norm(h, (c.hidden,), self.w(f"{i}.ffn_norm"), c.eps) @ self.w(f"{i}.wgu").T
                        ).split(c.ffn, -1)
            h = h + (F.silu(gate) * up) @ self.w(f"{i}.wdown").T
        out = F.rms_norm(h.view(S, N, B, -1)[:, :, B - c.proposals:], (c.hidden,), self.w("norm"), c.eps)
        return out @ self.head.T, out

    def qk_norm(self, x: Tensor, i: int, which: str) -> Tensor:
        """Layer i's per-head RMSNorm of q or k ([..., heads * D])."""
        c = self.cfg
        return F.rms_norm(x.unflatten(-1, (-1, c.head_dim)), (c.head_dim,), self.w(f"{i}.{which}_norm"),
                          c.eps).flatten(-2)

    def markov(self, prev: Tensor) -> Tensor:
        """The Markov head's bias for the positions after tokens ``prev`` (0 without a head)."""
        if not self.cfg.rank:
            return torch.zeros((), dtype=self.head.dtype)
        return self.w("markov_w1")[prev] @ self.w("markov_out").T

    def teacher(self, last: Tensor) -> Tensor:
        """The target's next-token distribution over the draft vocabulary from its last layer's
        outputs ``last`` [..., H]."""
        x = F.rms_norm(last, (self.cfg.hidden,), self.final_norm, self.cfg.eps)
        return torch.softmax(x @ self.head.T, -1)

    def confidence_inputs(self, h: Tensor, prev: Tensor) -> Tensor:
        """What the confidence head reads at a position: its hidden state ``h`` [..., H], and with
        `Confidence.MARKOV` the Markov table's row of the token before it ``prev``."""
        return h if self.cfg.confidence != Confidence.MARKOV else torch.cat([h, self.w("markov_w1")[prev]], -1)

    def confidence(self, h: Tensor, prev: Tensor) -> Tensor:
        """Logits of the confidence (the model applies the sigmoid); zeros without a head."""
        if self.cfg.confidence == Confidence.NONE:
            return torch.zeros(h.shape[:-1])
        return self.confidence_inputs(h, prev) @ self.w("conf") + self.w("conf_bias")


def soft_labels(model: DSparkTrain, last: Tensor, anchors: Tensor) -> Tensor:
    """The target's distributions [S, N, P, Vd] over each block's P proposed positions, from its
    last-layer outputs ``last`` [S, T, H] at the positions before them (``anchors`` [S, N])."""
    S, N = anchors.shape
    P = model.cfg.proposals
    at = (anchors[:, :, None] + torch.arange(P)).clamp(max=last.shape[1] - 1)   # position a + j predicts a + j + 1
    return model.teacher(last.gather(1, at.reshape(S, -1, 1).expand(-1, -1, last.shape[-1])).view(S, N, P, -1))


def losses(model: DSparkTrain, feats: Tensor, ids: Tensor, anchors: Tensor, lengths: Tensor, to_draft: Tensor,
           last: Tensor | None = None, distill: float = 0.0):
    """(weighted cross-entropy, confidence BCE, accepted-length tau, top-1) on a batch; tau is
    the mean count of leading positions whose Markov-chained greedy draft equals the target's.
    ``last`` [S, T, H]: the target's last-layer outputs, for the ``distill`` share of soft labels."""
    P = model.cfg.proposals
    base, h = model(feats, ids, anchors)
    prev, label, valid = block_targets(ids, anchors, lengths, P, to_draft)
    rows = base + model.markov(prev)
    weight = torch.exp(-torch.arange(P) / DECAY).expand_as(label)
    hit = valid & (label >= 0)
    ce = F.cross_entropy(rows[hit], label[hit], reduction="none")
    ce = (ce * weight[hit]).sum() / weight[hit].sum().clamp(min=1e-6)
    if distill > 0:
        p = soft_labels(model, last, anchors)
        soft = -(p[valid] * torch.log_softmax(rows[valid], -1)).sum(-1)
        ce = (1 - distill) * ce + distill * (soft * weight[valid]).sum() / weight[valid].sum().clamp(min=1e-6)
    right = (rows.argmax(-1) == label) & hit
    conf = model.confidence(h.detach(), prev)
    bce = F.binary_cross_entropy_with_logits(conf[valid], right[valid].float())
    tau = right.long().cumprod(-1).sum(-1).float()
    return ce, bce, tau.mean(), right[hit].float().mean()


def sample_anchors(starts: Tensor, lengths: Tensor, n: int, g: torch.Generator) -> Tensor:
    """``n`` anchors per sequence, uniform in [start, length - 2] (with replacement)."""
    span = (lengths - 1 - starts).clamp(min=1)
    return starts[:, None] + (torch.rand(len(starts), n, generator=g) * span[:, None]).long()


def schedule(lr: float, step: int, est: int) -> float:
    """Warm-up over 20 steps, then cosine to a tenth over ``est`` steps."""
    frac = min(1.0, step / max(1, est))
    return lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def now() -> float:
    return time.time()


# -- the run ---------------------------------------------------------------------------------------------------

def train_block(cfg: DSparkConfig, blob: dict, feats: list[Tensor], target, minutes: float, *, batch: int = 8,
                anchors: int = 16, lr: float = 1e-3, seed: int = 0, max_steps: int | None = None, distill: float = 0.0,
                refit_confidence: bool = False, mask_token: int = 0, say=print) -> dict:
    """Train for ``minutes`` (or ``max_steps``); returns {"weights": best by validation tau, "summary"}.
    ``distill``: the share of the cross-entropy against the target's soft labels (0 to 1).
    ``refit_confidence``: fit the confidence head again on the validation split at the end
    (`hal.training.confidence`). ``mask_token``: the mask rows are its embedding, frozen."""
    from hal.training.block_data import CANDIDATE_TAPS
    if not 0 <= distill <= 1:
        raise HalError(f"distill: expected a share in [0, 1], got {distill}")
    if any(t not in CANDIDATE_TAPS for t in cfg.taps):
        raise HalError(f"taps: expected layers the data records ({list(CANDIDATE_TAPS)}), got {list(cfg.taps)}")
    if distill > 0 and target.cfg.layers not in CANDIDATE_TAPS:
        raise HalError(f"distill: expected data that records the last layer's output (tap {target.cfg.layers}), "
                       f"got taps {list(CANDIDATE_TAPS)}")
    torch.manual_seed(seed)
    d = BlockData(blob, feats, [CANDIDATE_TAPS.index(t) for t in cfg.taps], cfg.draft_vocab, target.cfg.stop_ids,
                  seed, CANDIDATE_TAPS.index(target.cfg.layers) if distill > 0 else None)
    to_draft = to_draft_of(d.draft_ids, target.cfg.vocab)
    model = DSparkTrain(cfg, target.embed, target.head, d.draft_ids, mask_token, seed, target.w["norm"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    t0, step, est, best, curve = now(), 0, max_steps, (-1.0, None), []
    budget = minutes * 60
    while (max_steps is None or step < max_steps) and now() - t0 < budget:
        perm = [d.tr[i] for i in torch.randperm(len(d.tr), generator=g).tolist()]
        for b0 in range(0, len(perm) - batch + 1, batch):
            if (max_steps is not None and step >= max_steps) or now() - t0 >= budget:
                break
            if est is None and step == 5:
                est = int(budget / ((now() - t0) / 5))
            for group in opt.param_groups:
                group["lr"] = schedule(lr, step, est or 1000)
            f, ids, starts, lens, last = d.batch(perm[b0:b0 + batch])
            ce, bce, tau, _ = losses(model, f, ids, sample_anchors(starts, lens, anchors, g), lens, to_draft, last,
                                     distill)
            opt.zero_grad()
            (ce + 0.1 * bce).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            curve.append((now() - t0, step, ce.item(), bce.item(), tau.item(), None))
        v = validate(model, d, to_draft, batch, anchors)
        curve[-1] = curve[-1][:5] + (v["tau"],)
        say(f"step {step} ({now() - t0:.0f} s): ce {curve[-1][2]:.3f}, val tau {v['tau']:.3f}, "
            f"top-1 {v['top1']:.3f}, conf bce {v['bce']:.3f}")
        if v["tau"] > best[0]:
            best = (v["tau"], model.weights(), v)
    weights = {n: t.clone() for n, t in best[1].items()}
    report = None
    if refit_confidence and cfg.confidence != Confidence.NONE:   # on the validation split, which no step trained on
        try:
            weights["conf"], weights["conf_bias"], report = refit_on(cfg, weights, d, to_draft, target, mask_token)
            say(f"confidence head refitted: BCE {report['bce_out_of_fold']:.3f} out of fold, "
                f"{report['bce_joint_head']:.3f} trained with the drafter ({report['inputs']})")
        except HalError as e:
            report = {"skipped": str(e)}
            say(f"confidence head kept as trained: {e}")
    summary = {"steps": step, "minutes": minutes, "seconds": now() - t0, "val": best[2],
               "sequences": len(d.tr), "val_sequences": len(d.val), "lr": lr, "batch": batch, "anchors": anchors,
               "distill": distill,
               "seed": seed, "data_made": blob.get("made"), "curve": curve}
    if report is not None:
        summary["confidence"] = report
    return {"weights": weights, "summary": summary}


def refit_on(cfg: DSparkConfig, weights: dict, d: BlockData, to_draft: Tensor, target, mask_token: int):
    """`hal.training.confidence.refit` of the drafter ``weights``: (conf, conf_bias, report)."""
    from hal.training.confidence import refit
    return refit(from_weights(cfg, weights, target, mask_token), d, to_draft)


def from_weights(cfg: DSparkConfig, weights: dict, target, mask_token: int) -> DSparkTrain:
    """The training module of a drafter's ``weights`` (internal names and ``draft_ids``) for ``target``."""
    m = DSparkTrain(cfg, target.embed, target.head, weights["draft_ids"], mask_token, 0, target.w["norm"])
    with torch.no_grad():
        for name in cfg.shapes(len(target.embed)):
            m.w(name).copy_(weights[name])
    return m


def validate(model: DSparkTrain, d: BlockData, to_draft: Tensor, batch: int, anchors: int) -> dict:
    """Validation tau, top-1 and confidence BCE at fixed anchors."""
    g = torch.Generator().manual_seed(1234)
    out = []
    with torch.no_grad():
        for b0 in range(0, len(d.val), batch):
            f, ids, starts, lens, _ = d.batch(d.val[b0:b0 + batch])
            ce, bce, tau, top1 = losses(model, f, ids, sample_anchors(starts, lens, anchors, g), lens, to_draft)
            out.append((tau.item(), top1.item(), bce.item()))
    mean = lambda k: sum(o[k] for o in out) / len(out)  # noqa: E731
    return {"tau": mean(0), "top1": mean(1), "bce": mean(2)}


def run(model: str, out, minutes: float, *, block: int = 8, layers: int = 2, taps: tuple[int, ...] = (1, 8, 16, 24, 29),
        rank: int = 32, draft_size: int = 8192, seed: int = 0, max_new_tokens: int = 128, limit: int | None = None,
        sets: int = 2, layout: str = "dspark", mask_token: int | None = None, **kw) -> dict:
    """``spec-hal train-head --kind dspark``: data (cached), training, and the folder
    ``out``/{config.json, model.safetensors, train.json, loss.png}. Returns the summary.
    ``layout`` (a key of `LAYOUTS`): the architecture trained and the folder written, Qwen3 layers
    whose mask rows are ``mask_token``'s embedding (default: the target's first stop id); DSpark's
    anchor row proposes too, its Markov head is a table, its confidence head reads [h, markov_w1]."""
    import json
    from pathlib import Path

    from hal.models.block_layouts import DSPARK, write_block
    from hal.training import block_data
    from hal.training.curves import plot
    arch = LAYOUTS.get(layout)
    if arch is None:
        raise HalError(f"--layout: expected one of {list(LAYOUTS)}, got {layout!r}", arg="--layout")
    target, tok = block_data.load_target(model, None, None)
    c = target.cfg
    mask_token = c.stop_ids[0] if mask_token is None else mask_token
    if not 0 <= mask_token < c.vocab:   # before any data is made
        raise HalError(f"--mask-token: expected an id in [0, {c.vocab}), got {mask_token}", arg="--mask-token")
    blob = block_data.responses(model, max_new_tokens, limit, target, tok, sets=sets)
    feats = block_data.tapped(model, blob, target)
    cfg = DSparkConfig(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                      layers=layers, taps=tuple(taps), block=block, rank=rank if arch == DSPARK else 0,
                      draft_vocab=min(draft_size, c.vocab), eps=c.eps, anchor_predicts=arch == DSPARK,
                      confidence=Confidence.NONE if arch != DSPARK else
                      Confidence.MARKOV if rank else Confidence.HIDDEN)
    got = train_block(cfg, blob, feats, target, minutes, seed=seed, mask_token=mask_token, **kw)
    out = Path(out)
    summary = {"model": model, **got["summary"], "prompt_sets": sets, "layout": layout}
    curve = summary.pop("curve")
    write_block(out, cfg, got["weights"], mask_token, c.layers,
                (target.embed, target.head) if arch == DSPARK else None, kw.get("anchors", 16), c.vocab)
    summary["tokens"] = sum(len(s) for s in blob["ids"])
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "README.md").write_text(readme(model, cfg, summary, out, c.vocab))
    plot(curve, out / "loss.png", ("weighted cross-entropy vs target", "confidence BCE",
                                    "train tau (accepted length)", "validation tau"))
    return summary


def readme(model: str, cfg: DSparkConfig, s: dict, out, vocab: int) -> str:
    """The folder's README: what it is, how it was made, what it scored (from the run itself)."""
    import hashlib

    from hal.training.confidence import readme_line
    from hal.models.block_layouts import TOKEN_MAP
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    n = sum(math.prod(shape) for name, shape in cfg.shapes(vocab).items() if name != "mask")
    v = s["val"]
    layout = s["layout"]
    words = (f"the target's lm_head rows of a {cfg.draft_vocab}-token draft vocabulary (`{TOKEN_MAP}`)"
             if cfg.draft_vocab < vocab else "the target's whole vocabulary and lm_head")
    return (f"# Block drafter for {model} (layout `{layout}`: {LAYOUTS[layout]})\n\n"
            f"- Shape: {cfg.layers} draft layer{'s' if cfg.layers > 1 else ''} (hidden {cfg.hidden}, {cfg.heads} heads, {cfg.kv_heads} KV heads, "
            f"ffn {cfg.ffn}), block {cfg.block} "
            f"({cfg.proposals} proposals per forward), context features from the "
            f"inputs of target layers {list(cfg.taps)}, Markov head rank {cfg.rank}, confidence head "
            f"{cfg.confidence.name.lower()}; {words}. "
            f"fp16, {n / 1e6:.1f} M parameters of its own.\n"
            f"- `model.safetensors` sha256 `{sha}`.\n"
            f"- Made by: `python -m hal train-head --kind dspark --model {model} --minutes {s['minutes']:g} "
            f"--block {cfg.block} --layers {cfg.layers} --taps {','.join(map(str, cfg.taps))} --rank {cfg.rank} "
            f"--batch {s['batch']} --lr {s['lr']:g} --seed {s['seed']} --draft-vocab {cfg.draft_vocab}"
            + (f" --distill {s['distill']:g}" if s.get("distill") else "")
            + (f" --prompt-sets {s['prompt_sets']}" if s.get("prompt_sets", 2) != 2 else "")
            + f" --layout {layout}"
            + f"` ({time.strftime('%Y-%m-%d')}, torch "
            f"{torch.__version__}).\n"
            f"  - Data (`hal/training/block_data.py`): the target's greedy answers to the project's prompt set "
            f"(`hal/training/data.py`; held-out topics and benchmark-like prompts excluded), {s['tokens']:,} "
            f"tokens, made {s['data_made']}.\n"
            f"  - Training (`hal/training/dspark_train.py`): {s['steps']} steps over {s['sequences']} sequences "
            f"({s['anchors']} random anchors each per step), {s['seconds'] / 60:.1f} min; the checkpoint with the "
            f"best validation tau over {s['val_sequences']} held-back sequences is kept.\n"
            f"- Validation: tau (mean accepted length of the greedy block, teacher-forced) **{v['tau']:.3f}**, "
            f"top-1 {v['top1']:.3f}, confidence BCE {v['bce']:.3f}. `loss.png` is the curve.\n"
            + (readme_line(s["confidence"]) if "bce_out_of_fold" in s.get("confidence", {}) else ""))
