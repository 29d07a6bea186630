"""``python -m hal train-head``: train an EAGLE head for a model by self-distillation.

1. The target answers the project's prompt set (`hal.training.data`), greedily.
2. One batch-invariant forward per prompt + response records its features.
3. The head learns EAGLE's loss: regression of the next feature (smooth L1) plus cross-entropy
   against the target's own next-token distribution over the head's draft vocabulary.

Steps 1-2 are cached under ``$HAL_CACHE/eagle/``; the head is written as safetensors in the
published EAGLE layout (plus ``d2t``), with a loss curve as PNG."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from hal.errors import HalError


def data_path(model: str) -> Path:
    from hal.models.cache_dir import cache_dir
    return cache_dir() / "eagle" / f"{Path(model).name}-data.pt"


def build_data(model: str, max_new_tokens: int = 128, limit: int | None = None, out: Path | None = None) -> Path:
    """Generate responses and record features (cached: a second call reads the file)."""
    from tqdm import tqdm

    from hal.training import data as eagle_data
    from hal.models.fetch import load_model
    from hal.models.tokenizer import chatml
    from hal.registry import get_backend
    out = out or data_path(model)
    texts = eagle_data.prompts()[:limit]
    old = torch.load(str(out), weights_only=False) if out.exists() else None
    if old is not None and len(old["ids"]) >= len(texts):
        return out
    be = get_backend("cpu")
    target, tok = load_model(model, be)
    if tok is None:
        raise HalError(f"--model: expected a GGUF model with its tokenizer, got {model!r}")
    have = 0 if old is None else len(old["ids"])    # a cache of a prefix of the prompts is extended
    todo = texts[have:]
    seqs = eagle_data.generate(target, tok, todo, max_new_tokens)
    target.batch_invariant = True            # features exactly as the engine computes them
    with tqdm(total=len(seqs), desc="features", unit="seq") as bar:
        feats = eagle_data.features(target, seqs, progress=bar.update)
    prompt_lens = [len(tok.encode(chatml(t)).ids) for t in todo]
    if old is not None:
        seqs, feats, prompt_lens = old["ids"] + seqs, old["features"] + feats, old["prompt_lens"] + prompt_lens
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "ids": seqs, "features": feats, "prompt_lens": prompt_lens,
                "texts": texts[:len(seqs)], "made": time.strftime("%Y-%m-%d %H:%M:%S")}, str(out) + ".part")
    Path(str(out) + ".part").rename(out)
    return out


# -- the head, as a trainable module (the same maths as `hal.models.eagle.EagleModel`, EAGLE-1 layout) ------

class EagleTrain(torch.nn.Module):
    """EAGLE-1's layer (no input norm) over full causal sequences, for training; `weights`
    returns its tensors under the published names."""

    def __init__(self, H: int, heads: int, kv_heads: int, ffn: int, rope_base: float, eps: float):
        super().__init__()
        nn = torch.nn
        self.H, self.heads, self.kv_heads, self.D, self.eps = H, heads, kv_heads, H // heads, eps
        self.fc = nn.Linear(2 * H, H)
        self.q, self.k, self.v = (nn.Linear(H, n * self.D, bias=False) for n in (heads, kv_heads, kv_heads))
        self.o = nn.Linear(heads * self.D, H, bias=False)
        self.gate, self.up = nn.Linear(H, ffn, bias=False), nn.Linear(H, ffn, bias=False)
        self.down = nn.Linear(ffn, H, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(H))
        for m in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down):
            nn.init.normal_(m.weight, std=0.02)
        from hal.models.rope import Rope
        self.rope = Rope(self.D, rope_base, False)

    def forward(self, emb, feat):
        """emb, feat [B, T, H] (pairs (f_t, x_{t+1}) at positions t) -> next features [B, T, H]."""
        import torch.nn.functional as F
        B, T, H = emb.shape
        h = self.fc(torch.cat([emb, feat], -1))
        rot = self.rope(torch.arange(T))
        q = self.rope.apply(self.q(h).view(B * T, self.heads, self.D), rot.repeat(B, 1))
        k = self.rope.apply(self.k(h).view(B * T, self.kv_heads, self.D), rot.repeat(B, 1))
        q = q.view(B, T, self.heads, self.D).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.D).transpose(1, 2)
        v = self.v(h).view(B, T, self.kv_heads, self.D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(o.transpose(1, 2).reshape(B, T, -1))
        x = F.rms_norm(h, (H,), self.ffn_norm, self.eps)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))

    def weights(self) -> dict[str, Tensor]:
        p = "layers.0."
        return {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias, p + "self_attn.q_proj.weight": self.q.weight,
                p + "self_attn.k_proj.weight": self.k.weight, p + "self_attn.v_proj.weight": self.v.weight,
                p + "self_attn.o_proj.weight": self.o.weight, p + "mlp.gate_proj.weight": self.gate.weight,
                p + "mlp.up_proj.weight": self.up.weight, p + "mlp.down_proj.weight": self.down.weight,
                p + "post_attention_layernorm.weight": self.ffn_norm}


def draft_vocab(seqs: list[list[int]], size: int, keep: tuple[int, ...] = ()) -> Tensor:
    """The ``size`` most frequent ids of the data (ties and unseen slots: lower ids first,
    BPE's merge order), always including ``keep``; sorted."""
    counts = torch.zeros(max(max(s) for s in seqs) + 1 + size, dtype=torch.long)
    for s in seqs:
        counts.index_add_(0, torch.tensor(s), torch.ones(len(s), dtype=torch.long))
    for t in keep:
        counts[t] += 1 << 40
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]))


def config_json(cfg, ffn: int, draft_size: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": ffn, "num_hidden_layers": 1, "rms_norm_eps": cfg.eps, "rope_theta": 10000.0,
            "vocab_size": cfg.vocab, "draft_vocab_size": draft_size, "bias": True, "torch_dtype": "float16"}


@dataclass
class HeadData:
    """What a head trains on: each kept sequence's ids and target features, the draft vocabulary
    (``ids``) and its frozen lm_head rows (``W``), the target's embeddings, and the split."""

    seqs: list
    feats: list
    ids: Tensor
    W: Tensor
    embed: Tensor
    hidden: int
    tr: list[int]
    val: list[int]


def load_head_data(blob: dict, target, draft_size: int) -> HeadData:
    """The data `train` uses from the cached ``blob`` (prompts the data excludes are dropped);
    draws the validation split from torch's generator (seeded by the caller)."""
    from hal.training import data as eagle_data
    cfg = target.cfg
    texts = blob.get("texts")           # data without its prompt texts (a test's): all of it
    keep = [i for i in range(len(blob["ids"]))
            if texts is None or not any(w in texts[i].lower() for w in eagle_data.EXCLUDE)]
    seqs, feats = [blob["ids"][i] for i in keep], [blob["features"][i] for i in keep]
    ids = draft_vocab(seqs, draft_size, cfg.stop_ids)
    n_val = max(1, len(seqs) // 20)
    order = torch.randperm(len(seqs)).tolist()
    return HeadData(seqs, feats, ids, target.head[ids].contiguous(), target.embed, cfg.hidden,
                    order[n_val:], order[:n_val])


def batch_of(d: HeadData, idx: list[int]):
    """Inputs of one batch: the next tokens' embeddings, the features (in and out) and the mask."""
    T = max(len(d.seqs[i]) for i in idx) - 1
    emb = torch.zeros(len(idx), T, d.hidden)
    f = torch.zeros(len(idx), T + 1, d.hidden)
    mask = torch.zeros(len(idx), T)
    for j, i in enumerate(idx):
        s = torch.tensor(d.seqs[i])
        n = len(s) - 1
        emb[j, :n] = d.embed[s[1:]]
        f[j, :n + 1] = d.feats[i].float()
        mask[j, :n - 1] = 1                            # pair t predicts f_{t+1}, which must exist
    return emb, f[:, :-1], f[:, 1:], mask


def loss_of(d: HeadData, head, idx: list[int], noise: bool):
    """(feature regression, distillation cross-entropy, top-1 agreement) on a batch."""
    import torch.nn.functional as F
    emb, x, y, mask = batch_of(d, idx)
    if noise:
        x = x + (torch.rand_like(x) - 0.5) * 0.2       # EAGLE's U(-0.1, 0.1) feature noise
    pred = head(emb, x)
    m = mask.bool()
    reg = F.smooth_l1_loss(pred[m], y[m])
    p = torch.softmax(y[m] @ d.W.T, -1)
    logq = torch.log_softmax(pred[m] @ d.W.T, -1)
    ce = -(p * logq).sum(-1).mean()
    acc = (logq.argmax(-1) == p.argmax(-1)).float().mean()
    return reg, ce, acc


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
        import math
        if self.est_steps is None and self.steps == 5:
            self.est_steps = self.max_steps or int(self.budget / ((time.time() - self.t0) / 5))
        frac = 0.0 if self.est_steps is None else min(1.0, self.steps / self.est_steps)
        return self.lr * min(1.0, (self.steps + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_epoch(d: HeadData, head, opt, run: Run, batch: int, bar, epoch: int) -> None:
    """One pass over the training split in a random order (or until the run is done)."""
    perm = [d.tr[i] for i in torch.randperm(len(d.tr)).tolist()]
    for b0 in range(0, len(perm), batch):
        if run.done():
            break
        rate = run.rate()
        for g in opt.param_groups:
            g["lr"] = rate
        reg, ce, acc = loss_of(d, head, perm[b0:b0 + batch], True)
        loss = reg + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        run.steps += 1
        run.curve.append((time.time() - run.t0, run.steps, reg.item(), ce.item(), acc.item(), None))
        bar.n = int(min(run.budget, time.time() - run.t0))
        c = run.curve[-1]
        bar.set_postfix(epoch=epoch, reg=f"{c[2]:.3f}", ce=f"{c[3]:.2f}", acc=f"{c[4]:.2f}")
        bar.refresh()


def validate(d: HeadData, head, batch: int) -> dict:
    """The head's validation scores, as the block trainer's `hal.training.block_train.validate`
    reports them: {"top1": the share of next tokens whose draft is the target's}."""
    with torch.no_grad():
        vs = [loss_of(d, head, d.val[i:i + batch], False) for i in range(0, len(d.val), batch)]
    return {"top1": sum(float(a) for _, _, a in vs) / len(vs)}


def train(model: str, out: Path, minutes: float = 40.0, draft_size: int = 8192, ffn: int | None = None,
          batch: int = 8, lr: float = 1e-3, seed: int = 0, data: Path | None = None, target=None,
          max_steps: int | None = None) -> dict:
    """Train a head on the cached data for ``minutes`` (or ``max_steps``); write
    ``out``/{config.json, model.safetensors, loss.png, train.json}. Returns the summary (also
    in train.json). ``target``: the loaded model (else ``model`` is loaded)."""
    from tqdm import tqdm

    blob = torch.load(str(data or data_path(model)), weights_only=False)
    if target is None:
        from hal.models.fetch import load_model
        from hal.registry import get_backend
        target, _ = load_model(model, get_backend("cpu"))
    cfg = target.cfg
    torch.manual_seed(seed)
    d = load_head_data(blob, target, draft_size)
    head = EagleTrain(cfg.hidden, cfg.heads, cfg.kv_heads, ffn or cfg.ffn, 10000.0, cfg.eps)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    run, best, epoch = Run(minutes * 60, lr, max_steps), (-1.0, None), 0
    bar = tqdm(total=int(run.budget), desc="train", unit="s")
    while not run.done():
        train_epoch(d, head, opt, run, batch, bar, epoch)
        epoch += 1
        vacc = validate(d, head, batch)["top1"]
        run.curve[-1] = run.curve[-1][:5] + (vacc,)
        if vacc > best[0]:
            best = (vacc, {n: t.detach().clone() for n, t in head.weights().items()})
    bar.close()
    curve = run.curve
    summary = {"model": model, "minutes": minutes, "first_loss": curve[0][2] + 0.1 * curve[0][3],
               "last_loss": sum(c[2] + 0.1 * c[3] for c in curve[-5:]) / len(curve[-5:]), "steps": run.steps,
               "epochs": epoch, "sequences": len(d.tr), "val_sequences": len(d.val),
               "train_tokens": sum(len(d.seqs[i]) for i in d.tr), "draft_vocab": len(d.ids), "val_top1": best[0],
               "seed": seed, "lr": lr, "batch": batch, "data_made": blob.get("made")}
    write_head(out, best[1], d.ids, config_json(cfg, ffn or cfg.ffn, len(d.ids)), summary, curve)
    return summary


def write_head(out: Path, weights: dict, ids: Tensor, config: dict, summary: dict, curve) -> None:
    """``out``/{model.safetensors, config.json, train.json, loss.png}."""
    import json

    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.half().contiguous() for n, t in weights.items()}
    tensors["d2t"] = (ids - torch.arange(len(ids))).contiguous()   # EAGLE-3's draft -> target offsets
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(curve, out / "loss.png")


EAGLE_LABELS = ("feature regression (smooth L1)", "cross-entropy vs target", "train top-1 (noisy features)",
                "validation top-1")


def plot(curve, path: Path, labels: tuple[str, str, str, str] = EAGLE_LABELS) -> None:
    """Rows (seconds, step, loss a, loss b, train metric, validation metric or None) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    s = [c[1] for c in curve]
    ax[0].plot(s, [c[2] for c in curve], label=labels[0])
    ax[0].plot(s, [c[3] for c in curve], label=labels[1])
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].legend()
    ax[1].plot(s, [c[4] for c in curve], alpha=0.4, label=labels[2])
    v = [(c[1], c[5]) for c in curve if c[5] is not None]
    ax[1].plot([a for a, _ in v], [b for _, b in v], "o-", label=labels[3])
    ax[1].set_xlabel("step")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
