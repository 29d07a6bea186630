"""``spec-hal train-head --kind eagle``: an EAGLE-3 head trained by self-distillation, written in
SafeAILab's original EAGLE-3 layout (`hal.models.eagle_layouts.write_eagle3`: what SafeAILab's
code, vLLM and SGLang load).

1. Data (`hal.training.block_data`, shared with the block drafter): the target's greedy answers
   to the prompt set and the residual streams entering recorded layers, cached under
   ``$HAL_CACHE/dspark/``.
2. The head reads the streams entering layers (2, L//2, L-3), fused by ``fc``, as EAGLE-3 does.
   It learns cross-entropy against the target's next-token distribution over the draft
   vocabulary (from the last layer's output through the target's final norm and lm_head rows),
   at its first step and at ``TTT - 1`` chained steps that read its own previous output, weighted
   ``0.8^j`` (EAGLE-3's training-time test). Step j at anchor t sits at position t + j and sees
   the first step's keys of anchors <= t and its own chain's keys at anchor t, the keys the
   engine's draft chain sees (`hal.models.eagle.EagleModel`: committed pairs, then scratch)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models.eagle import EagleConfig
from hal.training.block_data import BlockData

TTT = 3          # unrolled draft steps per anchor
STEP_WEIGHT = 0.8


def eagle3_taps(layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps: the streams entering layers (2, L//2, L-3) (SafeAILab's target code)."""
    return (2, layers // 2, layers - 3)


class EagleTrain(torch.nn.Module):
    """An EAGLE-3 head (one layer, q/k/v over ``[norm(embed), hidden_norm(h)]``) over whole
    sequences with its training-time-test chain; `weights` gives its tensors under the internal
    names `hal.models.eagle.EagleModel` runs."""

    def __init__(self, cfg: EagleConfig, embed: Tensor, head_rows: Tensor, seed: int = 0):
        """``embed``: the target's embeddings; ``head_rows``: its lm_head rows of the draft
        vocabulary (the teacher's, and the head's own lm_head at the start)."""
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        H, D, nf = cfg.hidden, cfg.head_dim, len(cfg.feature_layers)
        self.cfg = cfg
        shapes = {"fc": (H, nf * H), "wqkv": ((cfg.heads + 2 * cfg.kv_heads) * D, 2 * H), "wo": (H, cfg.heads * D),
                  "wgu": (2 * cfg.ffn, H), "wdown": (H, cfg.ffn)}
        self.p = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
                                         for n, s in shapes.items()})
        for n in ("attn_norm", "hidden_norm", "ffn_norm", "norm"):
            self.p[n] = torch.nn.Parameter(torch.ones(H))
        self.p["head"] = torch.nn.Parameter(head_rows.float().clone())    # [Vd, H], from the target's lm_head
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("teacher", head_rows.float().clone(), persistent=False)
        from hal.models.rope import Rope
        self.rope = Rope(D, cfg.rope_base, False)

    def weights(self) -> dict[str, Tensor]:
        return {n: t.detach().clone() for n, t in self.p.items()}

    def forward(self, feats: Tensor, ids: Tensor, steps: int = TTT) -> list[Tensor]:
        """feats [B, T, n·H] (the taps at positions t), ids [B, T] -> draft-vocabulary logits
        [B, T, Vd] of each chained step j: anchor t's proposal for position t + j + 2, having read
        the tokens t + 1 .. t + j + 1 (ids past the end: anything; their rows are masked)."""
        cfg, p = self.cfg, self.p
        B, T, H = ids.shape[0], ids.shape[1], cfg.hidden
        nq, nk, D = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.head_dim
        groups = cfg.heads // cfg.kv_heads
        h = feats @ p["fc"].T
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        keys: list[tuple[Tensor, Tensor]] = []
        out = []
        for j in range(steps):
            nxt = torch.cat([ids[:, j + 1:], ids.new_zeros(B, j + 1)], 1)       # the token each anchor reads
            hn = F.rms_norm(h, (H,), p["hidden_norm"], cfg.eps)
            inp = torch.cat([F.rms_norm(self.embed[nxt], (H,), p["attn_norm"], cfg.eps), hn], -1)
            qkv = inp @ p["wqkv"].T
            rot = self.rope(torch.arange(T) + j).repeat(B, 1)
            q = self.rope.apply(qkv[..., :nq].reshape(B * T, cfg.heads, D), rot).view(B, T, cfg.heads, D)
            k = self.rope.apply(qkv[..., nq:nq + nk].reshape(B * T, cfg.kv_heads, D), rot)
            k = k.view(B, T, cfg.kv_heads, D).repeat_interleave(groups, 2)
            v = qkv[..., nq + nk:].reshape(B, T, cfg.kv_heads, D).repeat_interleave(groups, 2)
            keys.append((k, v))
            q = q.transpose(1, 2) * D ** -0.5                                  # [B, heads, T, D]
            k0, v0 = keys[0][0].transpose(1, 2), keys[0][1].transpose(1, 2)
            s0 = (q @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # first-step keys, anchors <= t
            own = [(q * ki.transpose(1, 2)).sum(-1, keepdim=True) for ki, _ in keys[1:]]   # chain keys at t
            a = torch.softmax(torch.cat([s0] + own, -1), -1)
            o = a[..., :T] @ v0
            for i, (_, vi) in enumerate(keys[1:]):
                o = o + a[..., T + i:T + i + 1] * vi.transpose(1, 2)
            h = h + o.transpose(1, 2).reshape(B, T, nq) @ p["wo"].T
            gate, up = (F.rms_norm(h, (H,), p["ffn_norm"], cfg.eps) @ p["wgu"].T).split(cfg.ffn, -1)
            h = h + (F.silu(gate) * up) @ p["wdown"].T
            out.append(F.rms_norm(h, (H,), p["norm"], cfg.eps) @ p["head"].T)
        return out


def head_data(blob: dict, feats: list[Tensor], taps: tuple[int, ...], layers: int, draft_size: int, stop_ids,
              seed: int) -> BlockData:
    """The data of `hal.training.block_data` for a head tapping ``taps``, with the last layer's
    outputs (the teacher's input; its validation split: the block trainer's, for the same seed)."""
    from hal.training.block_data import CANDIDATE_TAPS
    missing = [t for t in (*taps, layers) if t not in CANDIDATE_TAPS]
    if missing:
        raise HalError(f"taps: expected layers the data records ({list(CANDIDATE_TAPS)}), got {missing} "
                       f"(the head's taps {list(taps)} and the last layer's output, tap {layers})")
    return BlockData(blob, feats, [CANDIDATE_TAPS.index(t) for t in taps], draft_size, stop_ids, seed,
                     CANDIDATE_TAPS.index(layers))


def losses(head: EagleTrain, d: BlockData, idx: list[int], target_norm: Tensor, eps: float, noise: bool = False):
    """(weighted cross-entropy, per-step cross-entropy [TTT], per-step top-1 [TTT], teacher-forced
    accepted length) of a batch."""
    f, ids, _, lens, last = d.batch(idx)
    if noise:
        f = f + (torch.rand_like(f) - 0.5) * 0.2 * f.abs().mean()
    with torch.no_grad():
        p = torch.softmax(F.rms_norm(last, (last.shape[-1],), target_norm, eps) @ head.teacher.T, -1)
    out = head(f, ids)
    pos = torch.arange(ids.shape[1])
    ce, total, each, top1, run = 0.0, 0.0, [], [], None
    for j, logits in enumerate(out):
        m = pos[None] + j + 1 < lens[:, None]               # the teacher at position t + j + 1 exists
        want = torch.cat([p[:, j + 1:], p.new_zeros(p.shape[0], j + 1, p.shape[2])], 1)
        logq = torch.log_softmax(logits[m], -1)
        each.append(-(want[m] * logq).sum(-1).mean())
        ce = ce + STEP_WEIGHT ** j * each[-1]
        total += STEP_WEIGHT ** j
        hit = torch.zeros_like(m)
        hit[m] = logq.argmax(-1) == want[m].argmax(-1)
        top1.append(hit[m].float().mean())
        run = hit if run is None else run & hit
        if j == 0:
            base, accepted = m, hit.float()
        else:
            accepted = accepted + run.float()
    return ce / total, torch.stack(each).detach(), torch.stack(top1), accepted[base].mean()


@dataclass
class Run:
    """A training run's clock and schedule: steps so far, the loss curve, and when to stop."""

    budget: float
    lr: float
    max_steps: int | None
    t0: float = field(default_factory=time.time)
    steps: int = 0
    est_steps: int | None = None
    curve: list = field(default_factory=list)

    def done(self) -> bool:
        return time.time() - self.t0 >= self.budget or (self.max_steps is not None and self.steps >= self.max_steps)

    def rate(self) -> float:
        """Warm-up, then cosine to a tenth over the estimated steps."""
        if self.est_steps is None and self.steps == 5:
            self.est_steps = self.max_steps or int(self.budget / ((time.time() - self.t0) / 5))
        frac = 0.0 if self.est_steps is None else min(1.0, self.steps / self.est_steps)
        return self.lr * min(1.0, (self.steps + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def validate(head: EagleTrain, d: BlockData, target_norm: Tensor, eps: float, batch: int) -> dict:
    """{"top1": per-step top-1 on the held-back split, "tau": teacher-forced accepted length}."""
    with torch.no_grad():
        vs = [losses(head, d, d.val[i:i + batch], target_norm, eps) for i in range(0, len(d.val), batch)]
    return {"top1": [float(sum(v[2][j] for v in vs) / len(vs)) for j in range(TTT)],
            "tau": float(sum(v[3] for v in vs) / len(vs))}


def train_eagle(target, blob: dict, feats: list[Tensor], minutes: float, *, draft_size: int = 8192,
                batch: int = 8, lr: float = 1e-3, seed: int = 0, max_steps: int | None = None,
                init: dict[str, Tensor] | None = None, say=print) -> dict:
    """Train for ``minutes`` (or ``max_steps``): {"config", "weights" (best validation tau; with
    ``draft_ids``), "summary", "curve"}. ``init``: a head's weights (`hal.models.eagle_layouts.read_head`)
    to continue from; its draft vocabulary must be this data's."""
    c = target.cfg
    cfg = EagleConfig(version=3, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                      rope_base=10000.0, eps=c.eps, feature_layers=eagle3_taps(c.layers), draft_vocab=draft_size)
    torch.manual_seed(seed)
    d = head_data(blob, feats, cfg.feature_layers, c.layers, draft_size, c.stop_ids, seed)
    head = EagleTrain(cfg, target.embed, target.head[d.draft_ids], seed)
    if init is not None:
        if not torch.equal(init["draft_ids"].long(), d.draft_ids) or any(
                tuple(init.get(n, torch.empty(0)).shape) != tuple(p.shape) for n, p in head.p.items()):
            raise HalError("--init: expected a head of this target and data (the same draft vocabulary and shapes), "
                           "got one that differs")
        with torch.no_grad():
            for n, p in head.p.items():
                p.copy_(init[n].float())
    norm = target.w["norm"].float()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    run, best, epoch = Run(minutes * 60, lr, max_steps), (-1.0, None, None), 0
    g = torch.Generator().manual_seed(seed)
    while not run.done():
        perm = [d.tr[i] for i in torch.randperm(len(d.tr), generator=g).tolist()]
        for b0 in range(0, len(perm), batch):
            if run.done():
                break
            for group in opt.param_groups:
                group["lr"] = run.rate()
            ce, each, top1, _ = losses(head, d, perm[b0:b0 + batch], norm, c.eps, noise=True)
            opt.zero_grad()
            ce.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            run.steps += 1
            run.curve.append((time.time() - run.t0, run.steps, float(each[0]), float(each[-1]), float(top1[0]), None))
        epoch += 1
        v = validate(head, d, norm, c.eps, batch)
        run.curve[-1] = run.curve[-1][:5] + (v["tau"],)
        say(f"epoch {epoch}, step {run.steps} ({time.time() - run.t0:.0f} s): ce {run.curve[-1][2]:.3f}, "
            f"val top-1 {[round(x, 3) for x in v['top1']]}, tau {v['tau']:.3f}")
        if v["tau"] > best[0]:
            best = (v["tau"], head.weights(), v)
    weights = {n: t for n, t in best[1].items()} | {"draft_ids": d.draft_ids}
    summary = {"steps": run.steps, "epochs": epoch, "minutes": minutes, "seconds": time.time() - run.t0,
               "val": best[2], "sequences": len(d.tr), "val_sequences": len(d.val), "draft_vocab": len(d.draft_ids),
               "ttt": TTT, "seed": seed, "lr": lr, "batch": batch, "data_made": blob.get("made")}
    return {"config": cfg, "weights": weights, "summary": summary, "curve": run.curve}


def run_eagle(model: str, out: Path, minutes: float = 40.0, *, draft_size: int = 8192, sets: int = 2,
              max_new_tokens: int = 128, limit: int | None = None, init: str | Path | None = None, **kw) -> dict:
    """``spec-hal train-head --kind eagle``: data (cached), training (continued from the head in
    folder ``init``, if given), and the folder ``out`` in the EAGLE-3 layout with train.json,
    README.md and loss.png. Returns the summary."""
    import json

    from hal.models.eagle_layouts import write_eagle3
    from hal.training import block_data
    from hal.training.curves import plot
    blob = block_data.responses(model, max_new_tokens, limit, sets=sets)
    feats = block_data.tapped(model, blob)
    target, _ = block_data.load_target(model, None, None)
    start = None
    if init is not None:
        from hal.models.eagle_layouts import read_head
        start = read_head(init, target.cfg.layers)[1]
    got = train_eagle(target, blob, feats, minutes, draft_size=draft_size, init=start, **kw)
    summary = {"model": model, **got["summary"], "prompt_sets": sets, "tokens": sum(len(s) for s in blob["ids"])}
    if init is not None:
        summary["init"] = str(init)
    write_eagle3(Path(out), got["config"], got["weights"], target.cfg.vocab, target.cfg.layers)
    (Path(out) / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    (Path(out) / "README.md").write_text(readme(got["config"], summary, Path(out)))
    plot(got["curve"], Path(out) / "loss.png", ("cross-entropy vs target, step 1", f"cross-entropy, step {TTT}",
                                                 "train top-1, step 1", "validation tau"))
    return summary


def readme(cfg: EagleConfig, s: dict, out: Path) -> str:
    """The folder's README: what it is, how it was made, what it scored (from the run itself)."""
    import hashlib
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    H, D = cfg.hidden, cfg.head_dim
    n = H * len(cfg.feature_layers) * H + (cfg.heads + 2 * cfg.kv_heads) * D * 2 * H + H * cfg.heads * D \
        + 3 * H * cfg.ffn + s["draft_vocab"] * H
    v = s["val"]
    return (f"# EAGLE-3 head for {s['model']}\n\n"
            f"- Layout: SafeAILab's original EAGLE-3 (`LlamaForCausalLMEagle3`: `fc.weight [{H}, "
            f"{len(cfg.feature_layers) * H}]` over the residual streams entering target layers "
            f"{list(cfg.feature_layers)}, `midlayer.*` with q/k/v over `[norm(embed), hidden_norm(h)]`, `norm`, "
            f"`lm_head [{s['draft_vocab']}, {H}]`, `d2t`/`t2d`; no RoPE keys: base 10000), as "
            f"`hal.models.eagle_layouts.write_eagle3` writes it. fp16, {n / 1e6:.1f} M parameters.\n"
            f"- `model.safetensors` sha256 `{sha}`.\n"
            f"- Made by: `python -m hal train-head --kind eagle --model {s['model']} --minutes {s['minutes']:g} "
            f"--prompt-sets {s['prompt_sets']} --batch {s['batch']} --lr {s['lr']:g} --seed {s['seed']}"
            + (f" --init {s['init']}" if s.get("init") else "") + "` "
            f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}).\n"
            f"  - Data (`hal/training/block_data.py`): the target's greedy answers to the project's prompt set "
            f"(`hal/training/data.py`; held-out topics and benchmark-like prompts excluded), {s['tokens']:,} "
            f"tokens, made {s['data_made']}.\n"
            f"  - Training (`hal/training/eagle_train.py`): cross-entropy against the target's next-token distribution "
            f"over the draft vocabulary at the first step and {TTT - 1} chained steps (weights 0.8^j), "
            f"{s['steps']} steps over {s['sequences']} sequences, {s['seconds'] / 60:.1f} min; the checkpoint "
            f"with the best validation tau over {s['val_sequences']} held-back sequences is kept.\n"
            f"- Validation (teacher-forced): top-1 per chained step "
            f"{', '.join(f'{x:.3f}' for x in v['top1'])}; tau (the chain's accepted length, of {TTT}) "
            f"**{v['tau']:.3f}**. `loss.png` is the curve.\n")

