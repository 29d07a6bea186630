"""EAGLE heads: one decoder layer that drafts from the target's features, with its own KV
cache, over a reduced draft vocabulary (EAGLE-3's ``d2t``, FR-Spec).

- EAGLE-1 (``layers.0.*``, ``fc [H, 2H]``): the input is ``fc(cat(embed(x_{t+1}), f_t))`` with
  f_t the target's final normed hidden state; the layer's output is the next feature (the head
  regresses it), so chained steps feed it back; logits = lm_head(output).
- EAGLE-3 (``midlayer.*``, ``fc [H, 3H]``): f_t is the residual stream entering three target
  layers (low, mid, high) fused by fc; the layer reads ``cat(norm(embed), hidden_norm(h))``
  (``[*, 2H]`` q/k/v); chained steps feed back the layer's output; logits = lm_head(norm(out)).

Pair (f_t, x_{t+1}) sits at position t of the head's KV. Target features are committed to
the head's KV once; its own draft steps are scratch, truncated at the next call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from hal import kv
from hal.errors import HalError
from hal.models.llama import Batch, Llama, Rope, _rms_norm
from hal.requests import DraftBatch, Proposal


@dataclass(frozen=True)
class EagleConfig:
    version: int                  # 1 or 3
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float
    eps: float
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input residual streams are the features
    draft_vocab: int | None = None        # None: the target's whole vocabulary
    rope_scaling: dict | None = None      # HF's rope_scaling (llama3 or none)


class EagleModel:
    """An EAGLE head's weights (internal names) and its forward over the head's own KV."""

    def __init__(self, cfg: EagleConfig, w: dict[str, Tensor], target: Llama, backend=None, device=None):
        self.be = backend or target.be     # a placement may put the head on another backend / device
        self.device = torch.device(device) if device is not None else (
            target.device if backend is None else torch.device(backend.device_type))
        self.cfg = cfg
        tc = target.cfg
        if cfg.hidden != tc.hidden:
            raise HalError(f"head hidden_size: expected the target's {tc.hidden}, got {cfg.hidden}")
        nf = len(cfg.feature_layers) if cfg.version == 3 else 2
        want = {"fc": (cfg.hidden, nf * cfg.hidden),
                "wqkv": ((cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, (2 if cfg.version == 3 else 1) * cfg.hidden),
                "wo": (cfg.hidden, cfg.heads * cfg.head_dim), "wgu": (2 * cfg.ffn, cfg.hidden),
                "wdown": (cfg.hidden, cfg.ffn)}
        for name, shape in want.items():
            if name not in w or tuple(w[name].shape) != shape:
                raise HalError(f"head weight {name}: expected shape {list(shape)}, got "
                               f"{list(w[name].shape) if name in w else 'nothing'}")
        self.w = {n: t.to(self.device, torch.float32) for n, t in w.items()}
        self.embed = self.w.get("embed", target.embed.to(self.device))
        ids = self.w.get("draft_ids")
        self.draft_ids = None if ids is None else ids.long().to(self.device)
        if "head" not in self.w:   # the target's lm_head, restricted to the draft vocabulary
            head = target.head.to(self.device)
            self.w["head"] = head if ids is None else head[self.draft_ids].contiguous()
        self.head, self.vocab = self.w["head"], tc.vocab
        if self.draft_ids is not None and (self.draft_ids.min() < 0 or self.draft_ids.max() >= tc.vocab):
            raise HalError(f"head d2t: expected draft ids mapping into [0, {tc.vocab}), got "
                           f"[{int(self.draft_ids.min())}, {int(self.draft_ids.max())}]")
        self.rope = Rope(cfg.head_dim, cfg.rope_base, False, cfg.rope_scaling).to(self.device)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers if self.cfg.version == 3 else ()

    def forward(self, batch: Batch, k_cache: Tensor, v_cache: Tensor, tokens: Tensor, x: Tensor,
                from_target: bool, tree_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Draft-vocabulary logits [len(logits_rows), Vd] and the layer's output [T, H] (the
        next feature) for pairs (x: a feature per row, tokens: the token after it).
        ``from_target``: x is the target's feature (EAGLE-3 fuses it with fc); else it is the
        head's own previous output."""
        cfg, w = self.cfg, self.w
        T = tokens.shape[0]
        e = self.embed[tokens]
        if cfg.version == 1:
            h = F.linear(torch.cat([e, x], -1), w["fc"], w.get("fc_bias"))
            inp = h if "attn_norm" not in w else _rms_norm(h, w["attn_norm"], cfg.eps)
        else:
            h = F.linear(x, w["fc"]) if from_target else x
            inp = torch.cat([_rms_norm(e, w["attn_norm"], cfg.eps), _rms_norm(h, w["hidden_norm"], cfg.eps)], -1)
        nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkv = F.linear(inp, w["wqkv"])
        rot = self.rope(batch.positions, batch.max_position)
        q = self.rope.apply(qkv[:, :nq].view(T, cfg.heads, cfg.head_dim), rot)
        k = self.rope.apply(qkv[:, nq:nq + nk].view(T, cfg.kv_heads, cfg.head_dim), rot)
        v = qkv[:, nq + nk:].view(T, cfg.kv_heads, cfg.head_dim)
        self.be.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        o = self.be.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                    cfg.head_dim ** -0.5, tree_mask)
        h = h + F.linear(o.reshape(T, nq), w["wo"])
        gate, up = F.linear(_rms_norm(h, w["ffn_norm"], cfg.eps), w["wgu"]).split(cfg.ffn, -1)
        h = h + F.linear(F.silu(gate) * up, w["wdown"])
        out = h[batch.logits_rows]
        if cfg.version == 3:
            out = _rms_norm(out, w["norm"], cfg.eps)
        return out @ self.head.T, h

    def full_logits(self, draft_logits: Tensor) -> Tensor:
        """Draft-vocabulary logits spread over the target's vocabulary (-inf elsewhere)."""
        if self.draft_ids is None:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.vocab), float("-inf"))
        out[:, self.draft_ids] = draft_logits
        return out


# -- loading the published layouts ---------------------------------------------------------------

_LAYER = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
          "mlp.gate_proj": "wgate", "mlp.up_proj": "wup", "mlp.down_proj": "wdown",
          "post_attention_layernorm": "ffn_norm", "input_layernorm": "attn_norm", "hidden_norm": "hidden_norm"}


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            out.update(load_file(str(f)))
    else:
        for f in sorted(folder.glob("*.bin")):
            out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    if not out:
        raise HalError(f"head: expected *.safetensors or *.bin weights in {str(folder)!r}, got none")
    return out


def _layers(c: dict, version: int, target_layers: int) -> tuple[int, ...]:
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = target_layers   # ids name layer outputs; the runner taps the next layer's input
    return (tuple(i + 1 for i in ids) if ids else (2, L // 2, L - 3)) if version == 3 else ()


def head_feature_layers(path: str | Path, target_layers: int) -> tuple[int, ...]:
    """The target layers a head's features come from (``()``: the final normed hidden state),
    read from its folder without loading the weights (the target rank of a remote head)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HalError(f"head: expected a folder with config.json, got {str(path)!r}")
    names: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        from safetensors import safe_open
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    version = 3 if any(n.startswith("midlayer.") for n in names) else 1
    return _layers(json.loads((folder / "config.json").read_text()), version, target_layers)


def load_eagle(path: str | Path, target: Llama, backend=None, device=None) -> EagleModel:
    """An EAGLE-1 or EAGLE-3 head from a folder in the published HF layout (config.json +
    safetensors or pytorch_model.bin), for ``target`` (its embeddings and lm_head, unless the
    head has its own), on ``backend`` / ``device`` (default: the target's). The version is
    read off the names: ``midlayer.*`` is EAGLE-3, ``layers.0.*`` EAGLE-1."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HalError(f"head: expected a folder with config.json, got {str(path)!r}")
    c = json.loads((folder / "config.json").read_text())
    raw = _read_tensors(folder)
    version = 3 if any(n.startswith("midlayer.") for n in raw) else 1
    prefix = "midlayer." if version == 3 else "layers.0."
    w: dict[str, Tensor] = {}
    for name, t in raw.items():
        base = name.removesuffix(".weight")
        if name.startswith(prefix) and base[len(prefix):] in _LAYER:
            w[_LAYER[base[len(prefix):]]] = t.float()
        elif name == "fc.weight":
            w["fc"] = t.float()
        elif name == "fc.bias":
            w["fc_bias"] = t.float()
        elif name == "norm.weight":
            w["norm"] = t.float()
        elif name == "lm_head.weight":
            w["head"] = t.float()
        elif name == "embed_tokens.weight":
            w["embed"] = t.float()
        elif name == "d2t":
            w["draft_ids"] = torch.arange(t.shape[0]) + t.long()   # EAGLE-3 stores target id - draft id
    missing = [n for n in ("wq", "wk", "wv", "wo", "wgate", "wup", "wdown", "ffn_norm", "fc") if n not in w]
    if version == 3:
        missing += [n for n in ("attn_norm", "hidden_norm", "norm") if n not in w]
    if missing:
        raise HalError(f"head weights: expected the EAGLE-{version} layout, missing {missing}")
    w["wqkv"] = torch.cat([w.pop("wq"), w.pop("wk"), w.pop("wv")])
    w["wgu"] = torch.cat([w.pop("wgate"), w.pop("wup")])
    heads = c["num_attention_heads"]
    layers = _layers(c, version, target.cfg.layers)
    cfg = EagleConfig(version=version, hidden=c["hidden_size"], heads=heads,
                      kv_heads=c.get("num_key_value_heads", heads),
                      head_dim=c.get("head_dim", c["hidden_size"] // heads), ffn=c["intermediate_size"],
                      rope_base=float(c.get("rope_theta", 10000.0)), eps=float(c.get("rms_norm_eps", 1e-5)),
                      feature_layers=layers,
                      draft_vocab=c.get("draft_vocab_size") if "draft_ids" in w or "head" in w else None,
                      rope_scaling=c.get("rope_scaling"))
    return EagleModel(cfg, w, target, backend, device)


# -- drafting ------------------------------------------------------------------------------------

class HeadDrafter:
    """Drafts a chain with an `EagleModel` (a `hal.requests.Drafter` with ``features``).

    Per request its KV holds the pairs (f_t, x_{t+1}) of every committed position whose
    target feature it was passed (``valid``); each `propose` drops its previous scratch
    steps, feeds the new pairs in one ragged forward (the last one again when nothing is
    new), then drafts ``k`` tokens, each step feeding the head's own output back. A request
    whose features it missed (its KV was dropped while the request kept running) gets no
    drafts again (``lost`` counts them)."""

    def __init__(self, head: EagleModel, num_blocks: int = 512, block_size: int = 16):
        self.head, self.be = head, head.be
        c = head.cfg
        self.pool = kv.KVPool(head.be, num_blocks, block_size, c.kv_heads, c.head_dim, num_layers=1,
                              device=head.device)
        self.seqs: dict[int, kv.Sequence] = {}
        self.valid: dict[int, int] = {}      # rid -> pairs from target features in its KV (positions 0..valid-1)
        self.last: dict[int, Tensor] = {}    # rid -> the newest target feature passed (position valid - 1)
        self.lost_rids: set[int] = set()
        self.lost = 0

    @property
    def features(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def propose(self, b: DraftBatch) -> Proposal:
        from hal.drafters import empty, subset, widen
        if b.lengths is None:
            raise HalError("HeadDrafter.propose: expected host lengths (it is not a lookahead drafter), got None")
        if b.features is None and sum(b.num_features):
            raise HalError("HeadDrafter.propose: expected DraftBatch.features, got None")
        dev = self.head.device
        cu = [0]
        for n in b.num_features or (0,) * len(b.rids):
            cu.append(cu[-1] + n)
        keep, plan, K = [], [], max(b.k, default=0)
        a, need = self.pool.allocator, 0
        for i, (rid, L) in enumerate(zip(b.rids, b.lengths)):
            n = cu[i + 1] - cu[i]
            start, v = L - 1 - n, self.valid.get(rid, 0)
            q = self.seqs.get(rid)
            need += max(0, -(-(L - 1 + K) // a.block_size) - (len(q.blocks) if q is not None else 0))
            if start > v or (n == 0 and rid not in self.last) or rid in self.lost_rids or need > a.num_free:
                self._lose(rid)
                continue
            keep.append(i)
            plan.append((rid, L, max(0, v - start)))   # skip features it already has
        if not keep:
            return empty(len(b.rids), dev) if not any(b.k) else widen(b, [], None, dev)
        sub = b if len(keep) == len(b.rids) else subset(b, keep)
        part = self._propose(sub, plan)
        return part if sub is b else widen(b, keep, part, dev)

    def _propose(self, b: DraftBatch, plan) -> Proposal:
        from hal.drafters import _sample_chain
        from hal.forward import make_batch
        dev, head = self.head.device, self.head
        feats = None if b.features is None else b.features.to(dev, torch.float32)
        xs, toks, seqs, lens = [], [], [], []
        hist = b.history.to(dev)
        end = 0
        for i, ((rid, L, skip), n) in enumerate(zip(plan, b.num_features or (0,) * len(plan))):
            a, z, end = end + skip, end + n, end + n    # this request's rows of b.features, minus those it has
            q = self.seqs.setdefault(rid, self.pool.sequence())
            if z > a:                     # new target features: positions L-1-(z-a) .. L-2
                x = feats[a:z]
                self.last[rid] = x[-1]
            else:                         # nothing new: feed the newest pair again
                x = self.last[rid][None]
            p0 = L - 1 - x.shape[0]
            q.truncate(p0)
            xs.append(x)
            toks.append(hist[i, p0 + 1:L])
            seqs.append(q)
            lens.append(x.shape[0])
            self.valid[rid] = L - 1
        tokens, x = torch.cat(toks), torch.cat(xs)
        batch = make_batch(self.be, dev, self.pool, seqs, lens, tokens)
        logits0, h = head.forward(batch, self.pool.k[0], self.pool.v[0], tokens, x, True)
        for q, n in zip(seqs, lens):
            q.commit(n)
        state = {"h": h[batch.logits_rows]}
        if all(p.temperature == 0 for p in b.params):   # greedy: argmax over the draft vocabulary, no sampler
            return self._greedy_chain(b, seqs, logits0, state["h"])

        def step(prev, j):
            if j == 0:
                return head.full_logits(logits0)
            bt = make_batch(self.be, dev, self.pool, seqs, [1] * len(seqs), prev)
            logits, hh = head.forward(bt, self.pool.k[0], self.pool.v[0], prev, state["h"], False)
            for q in seqs:
                q.commit(1)
            state["h"] = hh
            return head.full_logits(logits)
        return _sample_chain(b, self.be, dev, step)

    def _greedy_chain(self, b: DraftBatch, seqs, logits: Tensor, h: Tensor) -> Proposal:
        from hal.drafters import slots
        from hal.forward import make_batch
        head, dev, toks = self.head, self.head.device, []
        for j in range(max(b.k, default=0)):
            if j:
                bt = make_batch(self.be, dev, self.pool, seqs, [1] * len(seqs), toks[-1])
                logits, h = head.forward(bt, self.pool.k[0], self.pool.v[0], toks[-1], h, False)
                for q in seqs:
                    q.commit(1)
            best = logits.argmax(-1)
            toks.append(best if head.draft_ids is None else head.draft_ids[best])
        return slots(torch.stack(toks, 1) if toks else torch.zeros(len(seqs), 0, dtype=torch.long, device=dev), b.k)

    def _lose(self, rid: int) -> None:
        if rid not in self.lost_rids:
            self.release(rid)
            self.lost_rids.add(rid)
            self.lost += 1

    def commit(self, rids, kept) -> None:
        pass   # draft steps are scratch: only target features are kept (truncated at the next call)

    def release(self, rid) -> None:
        if (q := self.seqs.pop(rid, None)) is not None:
            q.free()
        self.valid.pop(rid, None)
        self.last.pop(rid, None)
        self.lost_rids.discard(rid)   # a preempted request comes back with all its features


class NgramOrHead:
    """Best of both per request: n-gram lookup's drafts where it finds a match (copy-heavy
    text), the head's elsewhere (open-ended text). One extra host read per step (whether
    the lookup matched); the head is always passed its features, drafting 0 tokens for
    the rows the lookup covers."""

    def __init__(self, ngram, head: HeadDrafter):
        self.ngram, self.head, self.be = ngram, head, head.be

    @property
    def features(self) -> tuple[int, ...]:
        return self.head.features

    def propose(self, b: DraftBatch) -> Proposal:
        from dataclasses import replace

        from hal.forward import readback
        dev = self.head.head.device
        ng = self.ngram.propose(b)
        found = [int(v) for v in readback(torch.as_tensor(ng.num_valid))[0]] if ng.num_valid is not None else list(b.k)
        use = [f > 0 and k > 0 for f, k in zip(found, b.k)]
        hp = self.head.propose(replace(b, k=tuple(0 if u else k for u, k in zip(use, b.k))))
        cu = [0]
        for k in b.k:
            cu.append(cu[-1] + k)
        hcu = [0]
        for u, k in zip(use, b.k):
            hcu.append(hcu[-1] + (0 if u else k))
        src_ng = [cu[i] + j for i, u in enumerate(use) if u for j in range(b.k[i])]
        at_ng = src_ng
        at_h = [cu[i] + j for i, u in enumerate(use) if not u for j in range(b.k[i])]
        ids = torch.zeros(cu[-1], dtype=torch.long, device=dev)
        up = lambda v: torch.tensor(v, dtype=torch.long).to(dev)  # noqa: E731
        if at_ng:
            ids[up(at_ng)] = ng.draft_token_ids.to(dev)[up(src_ng)]
        if at_h:
            ids[up(at_h)] = hp.draft_token_ids
        probs = None
        if hp.draft_probs is not None:   # the lookup's drafts are deterministic: q is a point mass
            probs = torch.zeros(cu[-1], hp.draft_probs.shape[1], device=dev)
            if at_h:
                probs[up(at_h)] = hp.draft_probs
            if at_ng:
                probs[up(at_ng), ids[up(at_ng)]] = 1.0
        hv = hp.num_valid if hp.num_valid is not None else tuple(0 if u else k for u, k in zip(use, b.k))
        valid = tuple(min(f, k) if u else int(hv[i]) for i, (u, f, k) in enumerate(zip(use, found, b.k)))
        return Proposal(ids, up(cu), probs, valid)

    def commit(self, rids, kept) -> None:
        self.ngram.commit(rids, kept)
        self.head.commit(rids, kept)

    def release(self, rid) -> None:
        self.ngram.release(rid)
        self.head.release(rid)


# -- heads shipped with the package ----------------------------------------------------------------

HEADS_DIR = Path(__file__).parent / "models" / "heads"
SHIPPED = {   # model name -> (folder under hal/models/heads, sha256 of its model.safetensors)
    "smollm2-135m": ("smollm2-135m-eagle", "a324b230a2c5912621fbd105f18366daba17446053a93468739090178ee42918"),
}


def shipped_head(model: str) -> Path:
    """The folder of the head shipped for ``model`` (a `hal.models.fetch.MODELS` name or its
    GGUF path), its weights' sha256 checked."""
    from hal.models.fetch import MODELS, _sha256
    name = next((n for n in SHIPPED if model == n or Path(model).name == Path(MODELS[n]["member"]).name), None)
    if name is None:
        raise HalError(f"--draft eagle: expected a model with a shipped head ({sorted(SHIPPED)}) or eagle:<folder>, "
                       f"got {model!r}", arg="--draft")
    folder, sha = SHIPPED[name]
    path = HEADS_DIR / folder
    got = _sha256(path / "model.safetensors") if (path / "model.safetensors").is_file() else "no file"
    if sha is None or got != sha:
        raise HalError(f"head {folder}: expected model.safetensors with sha256 {sha}, got {got}")
    return path
