"""Self-distillation data for a block drafter (`hal.models.dspark`): the target's greedy
responses to the project's prompt set (`hal.training.data`, its held-out split apart) and the
residual streams entering a set of candidate target layers at every position.

Two caches under ``$HAL_CACHE/dspark/``: the responses (``<model>-ids.pt``, shared by every
layer choice) and the features at ``CANDIDATE_TAPS`` (``<model>-taps.pt``), so the tapped
layers can be chosen by measurement without running the target again (a cache of other
candidates is made anew)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from hal.errors import HalError

CANDIDATE_TAPS = (1, 2, 4, 8, 12, 15, 16, 20, 24, 27, 29, 30)   # layer inputs recorded (30: SmolLM2-135M's
#   last layer's output; 2, 15, 27: EAGLE-3's default taps (2, L//2, L-3)); a drafter taps a subset


def cache_paths(model: str) -> tuple[Path, Path]:
    from hal.models.cache_dir import cache_dir
    root = cache_dir() / "dspark"
    return root / f"{Path(model).name}-ids.pt", root / f"{Path(model).name}-taps.pt"


def _save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, str(path) + ".part")
    Path(str(path) + ".part").rename(path)


def responses(model: str, max_new_tokens: int = 128, limit: int | None = None, target=None, tok=None,
              sets: int = 2) -> dict:
    """{"ids": prompt + greedy response per prompt, "prompt_lens", "texts"} for the first ``limit``
    prompts of `hal.training.data.prompts` (its first ``sets`` sets), cached: a cache of a prefix of
    them is extended, a longer one is cut, one of other prompts is made anew."""
    from hal.training import data
    from hal.models.tokenizer import chatml
    path = cache_paths(model)[0]
    texts = data.prompts(sets=sets)[:limit]
    blob = {"ids": [], "prompt_lens": [], "texts": [], "made": None}
    if path.exists():
        cached = torch.load(str(path), weights_only=False)
        n = min(len(cached["texts"]), len(texts))
        if cached["texts"][:n] == texts[:n]:
            blob = cached
    if len(blob["ids"]) < len(texts):
        new = texts[len(blob["ids"]):]
        target, tok = load_target(model, target, tok)
        blob = {"ids": blob["ids"] + data.generate(target, tok, new, max_new_tokens),
                "prompt_lens": blob["prompt_lens"] + [len(tok.encode(chatml(t)).ids) for t in new],
                "texts": blob["texts"] + new,
                "made": " + ".join(filter(None, [blob["made"], time.strftime("%Y-%m-%d %H:%M:%S")]))}
        _save(blob, path)
    return {key: (v[:len(texts)] if isinstance(v, list) else v) for key, v in blob.items()}


def tapped(model: str, blob: dict, target=None, batch: int = 8) -> list[torch.Tensor]:
    """The residual streams entering `CANDIDATE_TAPS` at every position of each sequence
    ([len, len(CANDIDATE_TAPS), H] fp16), ``batch`` sequences per forward, cached with the
    sequences' ids: a cache of a prefix of them is extended, one of others made anew. The forward is
    the plain one (batched attention, not the batch-invariant path: a prefill of hundreds of rows
    through the invariant attention costs seconds per sequence); a drafter trains on features
    that differ from the engine's by rounding only."""
    path = cache_paths(model)[1]
    seqs = blob["ids"]
    out: list[torch.Tensor] = []
    if path.exists():
        cached = torch.load(str(path), weights_only=False)
        if isinstance(cached, dict) and cached["taps"] == CANDIDATE_TAPS:
            n = min(len(cached["feats"]), len(seqs))
            same = (cached["ids"][:n] == [list(s) for s in seqs[:n]] if "ids" in cached    # older caches: lengths
                    else all(f.shape[0] == len(s) for f, s in zip(cached["feats"], seqs)))
            out = cached["feats"] if same else []                 # another cache's sequences: made anew
    if len(out) < len(seqs):
        target, _ = load_target(model, target, None)
        out = out[:len(seqs)] + record(target, seqs[len(out):], batch)
        _save({"taps": CANDIDATE_TAPS, "feats": out, "ids": [list(s) for s in seqs]}, path)
    return out[:len(seqs)]


def record(target, seqs: list[list[int]], batch: int = 8) -> list[torch.Tensor]:
    """`tapped`'s features of ``seqs`` by ``target``, not cached."""
    from tqdm import tqdm

    from hal import kv
    from hal.engine.forward import forward_tokens
    inv, target.batch_invariant = target.batch_invariant, False
    out = []
    try:
        with tqdm(total=len(seqs), desc="features", unit="seq") as bar:
            for i in range(0, len(seqs), batch):
                part = seqs[i:i + batch]
                lens = [len(s) for s in part]
                pool = kv.KVPool(target.be, sum(-(-n // 16) for n in lens), 16, target.cfg.kv_heads,
                                 target.cfg.head_dim, dtype=target.dtype, num_layers=target.num_layers,
                                 device=target.device)
                rows = torch.arange(sum(lens))
                _, h = forward_tokens(target, pool, [pool.sequence() for _ in part], lens,
                                      torch.tensor([t for s in part for t in s]).to(target.device), rows=rows[-1:],
                                      hidden_rows=rows, feature_layers=CANDIDATE_TAPS)
                out += [f.view(n, len(CANDIDATE_TAPS), -1).half().cpu() for f, n in zip(h.split(lens), lens)]
                bar.update(len(part))
    finally:
        target.batch_invariant = inv
    return out


def block_targets(ids: Tensor, anchors: Tensor, lengths: Tensor, P: int, to_draft: Tensor):
    """(previous tokens [S, N, P], draft-vocabulary labels [S, N, P] (-1: outside it), valid
    positions [S, N, P]) of each block's P proposals (`DSparkConfig.proposals`: positions
    anchor + 1 .. anchor + P)."""
    j = torch.arange(1, P + 1)
    at = anchors[:, :, None] + j                                     # positions proposed
    valid = at < lengths[:, None, None]
    safe = at.clamp(max=ids.shape[1] - 1)
    S = ids.shape[0]
    flat = lambda t: ids.gather(1, t.reshape(S, -1)).view_as(t)  # noqa: E731
    return flat(safe - 1), to_draft[flat(safe)], valid


def to_draft_of(draft_ids: Tensor, vocab: int) -> Tensor:
    """Target id -> draft-vocabulary index (-1 outside it) [vocab]."""
    out = torch.full((vocab,), -1, dtype=torch.long)
    out[draft_ids.long()] = torch.arange(len(draft_ids))
    return out


def load_target(model: str, target, tok):
    """The target (``auto`` plan: what serves by default) and its tokenizer, unless given."""
    if target is not None:
        return target, tok
    from hal.models.fetch import load_model
    from hal.registry import get_backend
    target, tok = load_model(model, get_backend("cpu"), "auto")
    if tok is None:
        raise HalError(f"--model: expected a GGUF model with its tokenizer, got {model!r}", arg="--model")
    return target, tok


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


class BlockData:
    """Sequences (ids, tapped features) split into training and validation, the draft vocabulary."""

    def __init__(self, blob: dict, feats: list[Tensor], tap_index: list[int], draft_size: int, stop_ids, seed: int,
                 last_index: int | None = None):
        from hal.training import data as prompt_data
        texts = blob["texts"]
        keep = [i for i in range(len(blob["ids"])) if not any(w in texts[i].lower() for w in prompt_data.EXCLUDE)]
        self.ids = [torch.tensor(blob["ids"][i]) for i in keep]
        self.feats = [feats[i][:, tap_index].flatten(1) for i in keep]
        self.last = None if last_index is None else [feats[i][:, last_index] for i in keep]   # soft labels' source
        self.starts = torch.tensor([blob["prompt_lens"][i] - 1 for i in keep])
        self.draft_ids = draft_vocab([blob["ids"][i] for i in keep], draft_size, tuple(stop_ids))
        order = torch.randperm(len(keep), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val = max(1, len(keep) // 20)
        self.val, self.tr = order[:n_val], order[n_val:]

    def batch(self, idx: list[int]):
        """(features [S, T, taps * H], ids [S, T], starts [S], lengths [S], last-layer outputs [S, T, H] or None)."""
        T = max(len(self.ids[i]) for i in idx)
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        feats = torch.zeros(len(idx), T, self.feats[idx[0]].shape[1])
        last = None if self.last is None else torch.zeros(len(idx), T, self.last[idx[0]].shape[1])
        for j, i in enumerate(idx):
            ids[j, :len(self.ids[i])] = self.ids[i]
            feats[j, :len(self.ids[i])] = self.feats[i].float()
            if last is not None:
                last[j, :len(self.ids[i])] = self.last[i].float()
        return feats, ids, self.starts[idx], torch.tensor([len(self.ids[i]) for i in idx]), last
