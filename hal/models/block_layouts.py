"""Block drafters' folders in the published layouts, read by their config.

- **DFlash** (z-lab, ``"architectures": ["DFlashDraftModel"]``): Qwen3 layers (``layers.*``,
  with per-head q/k norms), ``fc`` [H, n·H], ``hidden_norm``, ``norm``; the target's embeddings
  and lm_head; ``dflash_config`` holds ``target_layer_ids`` and ``mask_token_id`` (``block_size``
  there or at the top level, as vLLM and SGLang read it). Row j >= 1 of a block proposes the
  token at the anchor's position + j: B - 1 proposals.
- **DSpark** (DeepSpec, ``"architectures": ["Qwen3DSparkModel"]``): the same layers, its own
  copies of the embeddings and lm_head, ``markov_head.markov_w1`` [V, r] (a table by token) and
  ``markov_w2`` [V, r], ``confidence_head.proj`` [1, H + r] (or [1, H]) with a bias; keys at the
  top level (``block_size``, ``target_layer_ids``, ``mask_token_id``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``). Every row,
  the anchor's too, proposes the token one past its position: B proposals. DeepSpec's "DFlash"
  checkpoints are this class with ``markov_rank`` 0 and no confidence head. A DSpark folder
  without the two copies (`without_copies`: the shipped SmolLM2-135M drafter's form) reads the
  target's own; `with_copies` writes them back.

spec-hal's own ``dspark-block`` layout (``"architecture": "dspark-block"``, shipped until stop 78)
is retired: such a folder is refused by name.

Both published layouts name the target layer whose **output** they read (``hidden_states[id +
1]`` in transformers; -1: the embeddings), which is the residual stream entering layer id + 1,
the tap `DSparkConfig` names. The mask rows are the embedding of ``mask_token_id``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from hal.errors import HalError
from hal.models.dspark import Confidence, DSparkConfig, DSparkModel
from hal.models.hf import read_json

DFLASH, DSPARK = "DFlashDraftModel", "Qwen3DSparkModel"
TOKEN_MAP = "token_map.pt"   # a published drafter's draft vocabulary (FR-Spec's hot tokens; SGLang's token map)
ARCHITECTURES = (DFLASH, DSPARK)
_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
          "mlp.down_proj.weight": "wdown"}
_FUSED = {"self_attn.q_proj.weight": ("wqkv", 0), "self_attn.k_proj.weight": ("wqkv", 1),
          "self_attn.v_proj.weight": ("wqkv", 2), "mlp.gate_proj.weight": ("wgu", 0), "mlp.up_proj.weight": ("wgu", 1)}
_TOP = {"fc.weight": "fc", "hidden_norm.weight": "hidden_norm", "norm.weight": "norm", "embed_tokens.weight": "embed",
        "lm_head.weight": "head", "markov_head.markov_w1.weight": "markov_w1",
        "markov_head.markov_w2.weight": "markov_out", "confidence_head.proj.weight": "conf",
        "confidence_head.proj.bias": "conf_bias"}


@dataclass(frozen=True)
class BlockLayout:
    """A block drafter folder's config: which layout, the drafter's `DSparkConfig` and the token
    whose embedding the mask rows are."""

    architecture: str
    cfg: DSparkConfig
    mask_token: int


def read_layout(folder: str | Path) -> BlockLayout:
    """The layout of a block drafter's ``folder`` from its config.json alone (no weights)."""
    path = Path(folder) / "config.json"
    c = read_json(path, "a block drafter's config.json")
    if c.get("architecture") == "dspark-block":
        raise HalError(f"block drafter {str(path)!r}: expected architectures {list(ARCHITECTURES)}, got spec-hal's "
                       f"retired dspark-block layout (retrain it: spec-hal train-head --kind dspark)")
    arch = (c.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise HalError(f"block drafter {str(path)!r}: expected architectures {list(ARCHITECTURES)}, got {arch!r}")
    return _published(path, c, arch)


def _published(path: Path, c: dict, arch: str) -> BlockLayout:
    sub = c.get("dflash_config") if isinstance(c.get("dflash_config"), dict) else {}

    def key(name, default=None, kind=int):
        v = sub.get(name, c.get(name, default))
        if v is None or kind is not None and (not isinstance(v, kind) or isinstance(v, bool) and kind is not bool):
            raise HalError(f"block drafter {str(path)!r} {name}: expected {kind.__name__ if kind else 'a value'}, "
                           f"got {v!r}")
        return v
    H, heads, layers = key("hidden_size"), key("num_attention_heads"), key("num_hidden_layers")
    if key("hidden_act", "silu", str) != "silu" or key("attention_bias", False, bool):
        raise HalError(f"block drafter {str(path)!r}: expected silu layers without attention biases (Qwen3's), got "
                       f"hidden_act {c.get('hidden_act')!r}, attention_bias {c.get('attention_bias')!r}")
    if any(t != "full_attention" for t in c.get("layer_types") or ()):
        raise HalError(f"block drafter {str(path)!r} layer_types: expected full_attention layers, got "
                       f"{c.get('layer_types')} (sliding-window draft layers are not supported)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HalError(f"block drafter {str(path)!r} rope: expected the default RoPE, got {rope}")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    if arch == DFLASH and "target_layer_ids" not in sub and "target_layer_ids" not in c:
        n, L = key("num_target_layers"), layers   # z-lab's default spread over the target's layers
        ids = [n // 2] if L == 1 else [round(1 + i * (n - 4) / (L - 1)) for i in range(L)]
    else:
        ids = key("target_layer_ids", kind=list)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= -1 for i in ids):
        raise HalError(f"block drafter {str(path)!r} target_layer_ids: expected layer ids >= -1, got {ids}")
    rank = key("markov_rank", 0) if arch == DSPARK else 0
    if rank and key("markov_head_type", "vanilla", str) != "vanilla":
        raise HalError(f"block drafter {str(path)!r} markov_head_type: expected 'vanilla' (the released DSpark "
                       f"head), got {c.get('markov_head_type')!r}")
    conf = Confidence.NONE
    if arch == DSPARK and key("enable_confidence_head", False, bool):
        conf = Confidence.MARKOV if key("confidence_head_with_markov", False, bool) else Confidence.HIDDEN
        if conf == Confidence.MARKOV and not rank:
            raise HalError(f"block drafter {str(path)!r} confidence_head_with_markov: expected a Markov head "
                           f"(markov_rank > 0), got markov_rank 0")
    try:
        cfg = DSparkConfig(hidden=H, heads=heads, kv_heads=key("num_key_value_heads", heads),
                          head_dim=key("head_dim", H // heads), ffn=key("intermediate_size"), layers=layers,
                          taps=tuple(i + 1 for i in ids), block=key("block_size"), rank=rank,
                          draft_vocab=key("vocab_size"), rope_base=float(theta), eps=float(key("rms_norm_eps", 1e-6,
                                                                                              None)),
                          anchor_predicts=arch == DSPARK, confidence=conf)
    except (TypeError, ValueError) as e:
        raise HalError(f"block drafter {str(path)!r}: expected a Qwen3 config, got {e}") from None
    return BlockLayout(arch, cfg, key("mask_token_id"))


def read_config(folder: str | Path) -> DSparkConfig:
    """A block drafter's config from its folder, without its weights (a target rank's taps)."""
    return read_layout(folder).cfg


def read_tensors(folder: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HalError(f"block drafter {str(folder)!r}: expected model.safetensors (or shards), got none")
    out = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise HalError(f"block drafter {str(f)!r}: expected a safetensors file, got {e}") from None
    return out


def published_weights(raw: dict[str, Tensor], cfg: DSparkConfig, folder: Path) -> dict[str, Tensor]:
    """A published checkpoint's tensors under `DSparkModel`'s internal names (q/k/v and gate/up
    fused; the confidence projection flattened); `HalError` naming a tensor no name maps."""
    w, parts = {}, {}
    for name, t in raw.items():
        if name in _TOP:
            w[_TOP[name]] = t.reshape(-1) if name == "confidence_head.proj.weight" else t
            continue
        pre, _, rest = name.partition(".")
        idx, _, sub = rest.partition(".")
        if pre != "layers" or not idx.isdigit() or int(idx) >= cfg.layers or sub not in {**_LAYER, **_FUSED}:
            raise HalError(f"block drafter {str(folder)!r} tensor {name}: expected the {cfg.layers}-layer Qwen3 "
                           f"drafter's weights, got a name no layer reads")
        if sub in _LAYER:
            w[f"{idx}.{_LAYER[sub]}"] = t
        else:
            fused, at = _FUSED[sub]
            parts.setdefault(f"{idx}.{fused}", {})[at] = t
    for name, got in parts.items():
        need = 3 if name.endswith("wqkv") else 2
        if len(got) != need or len({t.shape[1:] for t in got.values()}) != 1:
            raise HalError(f"block drafter {str(folder)!r} {name}: expected {need} projections of one input width, "
                           f"got {[list(t.shape) for t in got.values()]}")
        w[name] = torch.cat([got[i] for i in range(need)])
    return w


def load_block(folder: str | Path, target, backend=None, device=None) -> DSparkModel:
    """A block drafter from ``folder`` in either layout above, for ``target``."""
    _, cfg, w = read_block(folder, target)
    return DSparkModel(cfg, w, target, backend, device)


def read_block(folder: str | Path, target) -> tuple[BlockLayout, DSparkConfig, dict[str, Tensor]]:
    """(layout, config, weights under `DSparkModel`'s names) of the block drafter ``folder``,
    checked against ``target``: the mask row is ``mask_token_id``'s embedding, a token map gives
    ``draft_ids`` (else the whole vocabulary)."""
    folder = Path(folder)
    layout = read_layout(folder)
    w = published_weights(read_tensors(folder), layout.cfg, folder)
    vocab = target.cfg.vocab
    if layout.cfg.hidden != target.cfg.hidden:
        raise HalError(f"block drafter {str(folder)!r} hidden_size: expected the target's {target.cfg.hidden}, got "
                       f"{layout.cfg.hidden}")
    if layout.cfg.draft_vocab != vocab:
        raise HalError(f"block drafter {str(folder)!r} vocab_size: expected the target's {vocab}, got "
                       f"{layout.cfg.draft_vocab}")
    if not 0 <= layout.mask_token < vocab:
        raise HalError(f"block drafter {str(folder)!r} mask_token_id: expected an id in [0, {vocab}), got "
                       f"{layout.mask_token}")
    if ("embed" in w) != ("head" in w):
        raise HalError(f"block drafter {str(folder)!r}: expected both embed_tokens and lm_head (a DSpark checkpoint's "
                       f"copies of the target's) or neither (the target's own), got only "
                       f"{'embed_tokens' if 'embed' in w else 'lm_head'}")
    embed = w.get("embed", target.embed)
    if tuple(embed.shape) != (vocab, layout.cfg.hidden):
        raise HalError(f"block drafter {str(folder)!r} embed_tokens: expected [{vocab}, {layout.cfg.hidden}], got "
                       f"{list(embed.shape)}")
    if any(t > target.cfg.layers for t in layout.cfg.taps):
        raise HalError(f"block drafter {str(folder)!r} target_layer_ids: expected ids below the target's "
                       f"{target.cfg.layers} layers, got {[t - 1 for t in layout.cfg.taps]}")
    w["mask"] = embed[layout.mask_token].float()
    ids = token_map(folder, vocab)
    cfg = layout.cfg if ids is None else replace(layout.cfg, draft_vocab=len(ids))
    w["draft_ids"] = torch.arange(vocab) if ids is None else ids
    if ids is not None and "markov_out" in w:
        w["markov_out"] = w["markov_out"][ids]
    return layout, cfg, w


def token_map(folder: Path, vocab: int) -> Tensor | None:
    """The draft vocabulary of ``folder``'s `TOKEN_MAP` (sorted distinct ids of the target's
    ``vocab``), or None without one. The file is untrusted: loaded as plain tensors only."""
    path = folder / TOKEN_MAP
    if not path.exists():
        return None
    try:
        ids = torch.as_tensor(torch.load(str(path), map_location="cpu", weights_only=True))
    except Exception as e:   # torch's own errors for a corrupt or unsafe file
        raise HalError(f"block drafter {str(path)!r}: expected a tensor of token ids, got {type(e).__name__}: {e}"
                       ) from None
    if ids.dim() != 1 or not len(ids) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool \
            or ids.min() < 0 or ids.max() >= vocab or len(ids.unique()) != len(ids):
        raise HalError(f"block drafter {str(path)!r}: expected distinct token ids in [0, {vocab}), got "
                       f"{ids.dtype} of shape {list(ids.shape)}")
    return ids.long().sort().values


def write_block(out: str | Path, cfg: DSparkConfig, w: dict[str, Tensor], mask_token: int, target_layers: int,
                copies: tuple[Tensor, Tensor] | None = None, anchors: int = 16, vocab: int | None = None) -> str:
    """``out``/{config.json, model.safetensors}: a block drafter (internal names) in the published
    layout its config can be written in, fp16: DeepSpec's ``Qwen3DSparkModel`` where the anchor's
    row proposes (``copies``: the embeddings and lm_head it ships, the target's, kept in their own
    dtype), else z-lab's
    ``DFlashDraftModel`` (no Markov or confidence head; the target's embeddings and lm_head).
    The mask rows must be ``mask_token``'s embedding; ``anchors``: the blocks per sequence it
    trained on (DeepSpec's constructor requires ``num_anchors``). A drafter over a draft
    vocabulary (``w["draft_ids"]``, of the target's ``vocab``) is written over the whole vocabulary
    (``markov_w2`` rows outside it zero) with its ids in `TOKEN_MAP`, as SGLang's
    ``--speculative-token-map`` reads them. Returns the architecture written."""
    import json

    from safetensors.torch import save_file
    arch = DSPARK if cfg.anchor_predicts else DFLASH
    ids = w["draft_ids"].long()
    vocab = cfg.draft_vocab if vocab is None else vocab
    whole = torch.equal(ids, torch.arange(vocab))
    why = [what for what, bad in (
        ("draft ids of the target's vocabulary", len(ids) != cfg.draft_vocab or len(ids.unique()) != len(ids)
         or not whole and (ids.min() < 0 or ids.max() >= vocab)),
        ("DFlash: no Markov or confidence head", arch == DFLASH and (cfg.rank or cfg.confidence != Confidence.NONE)),
        ("DSpark: copies of the embeddings and lm_head", arch == DSPARK and copies is None))
        if bad]
    if why:
        raise HalError(f"write_block: expected a drafter the published layouts hold ({'; '.join(why)}), got {cfg}")
    t = {"fc.weight": w["fc"], "hidden_norm.weight": w["hidden_norm"], "norm.weight": w["norm"]}
    nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        q, k, v = w[f"{i}.wqkv"].split([nq, nk, nk])
        gate, up = w[f"{i}.wgu"].split(cfg.ffn)
        t |= {f"layers.{i}.self_attn.q_proj.weight": q, f"layers.{i}.self_attn.k_proj.weight": k,
              f"layers.{i}.self_attn.v_proj.weight": v, f"layers.{i}.mlp.gate_proj.weight": gate,
              f"layers.{i}.mlp.up_proj.weight": up}
        t |= {f"layers.{i}.{name}": w[f"{i}.{key}"] for name, key in _LAYER.items()}
    if arch == DSPARK:
        if cfg.rank:
            w2 = w["markov_out"].new_zeros(vocab, cfg.rank).index_copy(0, ids, w["markov_out"])
            t |= {"markov_head.markov_w1.weight": w["markov_w1"], "markov_head.markov_w2.weight": w2}
        if cfg.confidence != Confidence.NONE:
            t |= {"confidence_head.proj.weight": w["conf"][None], "confidence_head.proj.bias": w["conf_bias"]}
    t = {n: x.detach().half().contiguous() for n, x in t.items()}
    if arch == DSPARK:   # the target's values as they are (fp16 would round a dequantized GGUF's)
        t |= {"embed_tokens.weight": copies[0].detach().clone(), "lm_head.weight": copies[1].detach().clone()}
    c = {"architectures": [arch], "model_type": "qwen3", "attention_bias": False, "hidden_act": "silu",
         "hidden_size": cfg.hidden, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
         "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
         "layer_types": ["full_attention"] * cfg.layers, "rms_norm_eps": cfg.eps, "vocab_size": vocab,
         "tie_word_embeddings": False, "block_size": cfg.block, "num_target_layers": target_layers}
    layer_ids = [tap - 1 for tap in cfg.taps]      # the published ids name layer outputs
    if arch == DFLASH:   # transformers-4 style, as z-lab writes its configs
        c |= {"rope_theta": cfg.rope_base, "torch_dtype": "float16",
              "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": mask_token}}
    else:                # transformers-5 style, as DeepSpec writes its configs
        c |= {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base}, "dtype": "float16",
              "target_layer_ids": layer_ids, "mask_token_id": mask_token, "num_anchors": anchors,
              "markov_rank": cfg.rank,
              "markov_head_type": "vanilla", "enable_confidence_head": cfg.confidence != Confidence.NONE,
              "confidence_head_with_markov": cfg.confidence == Confidence.MARKOV}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(c, indent=1) + "\n")
    if not whole:
        torch.save(ids.clone(), out / TOKEN_MAP)
    return arch


def rewrite(folder: Path, out: Path, tensors: dict[str, Tensor]) -> None:
    """``out``: ``folder``'s config (and token map) with ``tensors`` as its model.safetensors."""
    import shutil

    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("config.json", TOKEN_MAP):
        if (folder / name).exists():
            shutil.copyfile(folder / name, out / name)


def without_copies(folder: str | Path, out: str | Path, target) -> None:
    """``out``: the DSpark checkpoint ``folder`` without its embed_tokens and lm_head, which must
    be ``target``'s at their own precision (a shipped drafter's form: `load_block` reads the
    target's own, and `with_copies` writes them back)."""
    folder, raw = Path(folder), read_tensors(Path(folder))
    for name, mine in (("embed_tokens.weight", target.embed), ("lm_head.weight", target.head)):
        if name not in raw or not torch.equal(raw[name], mine.to(raw[name].dtype)):
            raise HalError(f"block drafter {str(folder)!r} {name}: expected a copy of the target's, got "
                           f"{'nothing' if name not in raw else 'other values'}")
        del raw[name]
    rewrite(folder, Path(out), raw)


def with_copies(folder: str | Path, out: str | Path, target) -> None:
    """``out``: the block drafter ``folder`` whole, as its authors' loaders read it: a DSpark
    checkpoint that borrows the target's embeddings and lm_head gets copies of ``target``'s (its
    own values, float32); other layouts are copied as they are. ``folder`` loads for ``target``
    first, so nothing is written for a drafter that does not fit it."""
    folder = Path(folder)
    load_block(folder, target)
    raw = read_tensors(folder)
    if read_layout(folder).architecture == DSPARK and "embed_tokens.weight" not in raw:
        raw |= {"embed_tokens.weight": target.embed.float().clone(), "lm_head.weight": target.head.float().clone()}
    rewrite(folder, Path(out), raw)
