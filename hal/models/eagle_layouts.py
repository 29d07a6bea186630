"""EAGLE heads' folders, read by their config: the published layouts.

- **EAGLE-1** (SafeAILab): ``layers.0.*`` (q/k/v of width H), ``fc`` [H, 2H] (+ bias) over
  ``[embedding, feature]``; the feature is the target's final normed hidden state.
- **EAGLE-3, original** (SafeAILab, ``"architectures": ["LlamaForCausalLMEagle3"]``, usually
  ``pytorch_model.bin`` in fp16): ``midlayer.*`` (q/k/v of width 2H: the normed embedding, then
  the normed feature), ``fc`` [H, n·H], ``norm``, ``lm_head`` [Vd, H], ``d2t`` (target id = draft
  id + d2t), ``t2d`` (a training mask, unused), an optional ``embed_tokens``. Its config has no
  RoPE keys: the head's base is 10000 whatever the target's. The features enter the target
  layers (2, L//2, L-3), or ``eagle_config.eagle_aux_hidden_state_layer_ids`` + 1 (ids that
  name layer outputs, as NVIDIA ModelOpt writes them).
- **EAGLE-3, speculators** (``"speculators_model_type": "eagle3"``): the same tensors as
  ``layers.0.*``, hyper-parameters in ``transformer_layer_config`` (Llama or Qwen3: then per-head
  q/k norms), ``eagle_aux_hidden_state_layer_ids`` at the top level naming layer inputs (vLLM's
  convention, used as they are), ``norm_before_residual`` (True where the key is missing, as
  vLLM reads it). ``norm_before_fc``, ``fc_norm``, ``norm_output`` and heads of more than one
  layer are refused by name rather than run wrong."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hal.errors import HalError
from hal.models.eagle import EagleConfig, EagleModel
from hal.models.hf import read_json
from hal.models.llama import Llama

_LAYER = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
          "mlp.gate_proj": "wgate", "mlp.up_proj": "wup", "mlp.down_proj": "wdown",
          "post_attention_layernorm": "ffn_norm", "input_layernorm": "attn_norm", "hidden_norm": "hidden_norm",
          "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
_TOP = {"fc.weight": "fc", "fc.bias": "fc_bias", "norm.weight": "norm", "lm_head.weight": "head",
        "embed_tokens.weight": "embed"}
_REFUSED = ("norm_before_fc", "fc_norm", "norm_output")   # speculators' variants not run here


@dataclass(frozen=True)
class EagleLayout:
    """What a head's config.json says: its version, the model hyper-parameters (the top level, or
    speculators' ``transformer_layer_config``), its taps rule and its flags."""

    version: int
    speculators: bool
    hp: dict
    config: dict

    def taps(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input residual streams are the features (``()``: EAGLE-1's
        final normed hidden state)."""
        if self.version == 1:
            return ()
        top = self.config.get("eagle_aux_hidden_state_layer_ids")
        nested = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if top:      # vLLM's and speculators' ids name layer inputs
            return tuple(sorted(top))
        if nested:   # ModelOpt's name layer outputs: the next layer's input
            return tuple(sorted(i + 1 for i in nested))
        return (2, target_layers // 2, target_layers - 3)


def read_layout(folder: str | Path) -> EagleLayout:
    path = Path(folder) / "config.json"
    c = read_json(path, "an EAGLE head's config.json")
    spec = c.get("speculators_model_type")
    if spec is not None:
        if spec != "eagle3" or not isinstance(c.get("transformer_layer_config"), dict):
            raise HalError(f"head {str(path)!r} speculators_model_type: expected 'eagle3' with a "
                           f"transformer_layer_config, got {spec!r}")
        for key in _REFUSED:
            if c.get(key):
                raise HalError(f"head {str(path)!r} {key}: expected false (not supported), got {c[key]!r}")
        return EagleLayout(3, True, c["transformer_layer_config"], c)
    arch = " ".join(c.get("architectures") or ())
    names = _names(Path(folder)) if "Eagle3" not in arch else ()
    version = 3 if "Eagle3" in arch or any(n.startswith("midlayer.") for n in names) else 1
    return EagleLayout(version, False, c, c)


def _names(folder: Path) -> list[str]:
    """The tensor names of a head's weight files, without reading the tensors."""
    from safetensors import safe_open
    out: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out += list(h.keys())
    if not out:
        for f in sorted(folder.glob("*.bin")):
            out += list(torch.load(str(f), map_location="cpu", weights_only=True, mmap=True))
    return out


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, Tensor] = {}
    try:
        if files:
            from safetensors.torch import load_file
            for f in files:
                out.update(load_file(str(f)))
        else:
            for f in sorted(folder.glob("*.bin")):
                out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    except Exception as e:   # a corrupt or unsafe file: safetensors' and torch's own errors
        raise HalError(f"head: expected readable *.safetensors or *.bin weights in {str(folder)!r}, got "
                       f"{type(e).__name__}: {e}") from None
    if not out:
        raise HalError(f"head: expected *.safetensors or *.bin weights in {str(folder)!r}, got none")
    return out


def head_feature_layers(path: str | Path, target_layers: int) -> tuple[int, ...]:
    """The target layers a head's features come from (``()``: the final normed hidden state),
    read from its folder without loading the weights (the target rank of a remote head)."""
    return read_layout(path).taps(target_layers)


def _weights(raw: dict[str, Tensor], layout: EagleLayout, folder: Path) -> dict[str, Tensor]:
    prefix = "midlayer." if layout.version == 3 and not layout.speculators and \
        any(n.startswith("midlayer.") for n in raw) else "layers.0."
    w: dict[str, Tensor] = {}
    for name, t in raw.items():
        base = name.removesuffix(".weight")
        if name.startswith(prefix) and name.endswith(".weight") and base[len(prefix):] in _LAYER:
            w[_LAYER[base[len(prefix):]]] = t.float()
        elif name in _TOP:
            w[_TOP[name]] = t.float()
        elif name == "d2t":
            w["draft_ids"] = torch.arange(t.shape[0]) + t.long()   # EAGLE-3 stores target id - draft id
        elif name != "t2d":
            raise HalError(f"head {str(folder)!r} tensor {name}: expected the one-layer EAGLE-{layout.version} "
                           f"layout's tensors, got a name it has not (a variant this loader would run wrong)")
    missing = [n for n in ("wq", "wk", "wv", "wo", "wgate", "wup", "wdown", "ffn_norm", "fc") if n not in w]
    if layout.version == 3:
        missing += [n for n in ("attn_norm", "hidden_norm", "norm") if n not in w]
    if missing:
        raise HalError(f"head weights: expected the EAGLE-{layout.version} layout, missing {missing}")
    w["wqkv"] = torch.cat([w.pop("wq"), w.pop("wk"), w.pop("wv")])
    w["wgu"] = torch.cat([w.pop("wgate"), w.pop("wup")])
    return w


def read_head(path: str | Path, target_layers: int) -> tuple[EagleConfig, dict[str, Tensor]]:
    """A head folder's config and weights (internal names, ``draft_ids``) for a target of
    ``target_layers`` layers, as `load_eagle` runs them; `HalError` naming what does not fit."""
    folder = Path(path)
    layout = read_layout(folder)
    hp = layout.hp
    for key in ("num_hidden_layers", "attention_bias", "mlp_bias"):
        want = 1 if key == "num_hidden_layers" else False
        if hp.get(key, want) != want:
            raise HalError(f"head {str(folder)!r} {key}: expected {want} (a one-layer head without biases), got "
                           f"{hp[key]!r}")
    w = _weights(_read_tensors(folder), layout, folder)
    rope = hp.get("rope_parameters") or {}
    scaling = hp.get("rope_scaling")
    if rope.get("rope_type", "default") != "default":
        scaling = rope
    try:
        heads = hp["num_attention_heads"]
        cfg = EagleConfig(version=layout.version, hidden=hp["hidden_size"], heads=heads,
                          kv_heads=hp.get("num_key_value_heads", heads),
                          head_dim=hp.get("head_dim") or hp["hidden_size"] // heads, ffn=hp["intermediate_size"],
                          rope_base=float(rope.get("rope_theta", hp.get("rope_theta", 10000.0))),
                          eps=float(hp.get("rms_norm_eps", 1e-5)), feature_layers=layout.taps(target_layers),
                          draft_vocab=(layout.config.get("draft_vocab_size") or hp.get("draft_vocab_size"))
                          if "draft_ids" in w or "head" in w else None,
                          rope_scaling=scaling, qk_norm="q_norm" in w,
                          norm_before_residual=layout.speculators and layout.config.get("norm_before_residual", True))
    except (KeyError, TypeError, ValueError) as e:
        raise HalError(f"head {str(folder)!r}: expected the head's hidden_size, num_attention_heads and "
                       f"intermediate_size in its config, got {type(e).__name__}: {e}") from None
    if any(not 0 <= t <= target_layers for t in cfg.feature_layers):
        raise HalError(f"head {str(folder)!r} eagle_aux_hidden_state_layer_ids: expected layers in [0, "
                       f"{target_layers}] of the target, got taps {list(cfg.feature_layers)}")
    return cfg, w


def load_eagle(path: str | Path, target: Llama, backend=None, device=None) -> EagleModel:
    """An EAGLE-1 or EAGLE-3 head from a folder in a published layout (config.json +
    safetensors or pytorch_model.bin), for ``target`` (its embeddings and lm_head, unless the
    head has its own), on ``backend`` / ``device`` (default: the target's)."""
    cfg, w = read_head(path, target.cfg.layers)
    return EagleModel(cfg, w, target, backend, device)


_WRITE_LAYER = {"wo": "self_attn.o_proj", "wdown": "mlp.down_proj", "attn_norm": "input_layernorm",
                "hidden_norm": "hidden_norm", "ffn_norm": "post_attention_layernorm"}


def write_eagle3(out: str | Path, cfg: EagleConfig, w: dict[str, Tensor], vocab: int, layers: int) -> None:
    """``out``/{config.json, model.safetensors}: an EAGLE-3 head (internal names, with
    ``draft_ids``) in SafeAILab's original layout, fp16, as its published heads are written
    (``LlamaForCausalLMEagle3``, ``midlayer.*``, ``d2t``/``t2d``, no RoPE keys: base 10000).
    ``vocab`` and ``layers``: the target's. Taps other than its (2, L//2, L-3) are written as
    ModelOpt's ``eagle_config`` ids (layer outputs: each tap minus one)."""
    import json

    from safetensors.torch import save_file
    if cfg.version != 3 or cfg.qk_norm or cfg.norm_before_residual or cfg.rope_base != 10000.0 or cfg.rope_scaling:
        raise HalError(f"write_eagle3: expected a plain EAGLE-3 head (RoPE base 10000, no q/k norms), got {cfg}")
    nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    ids = w["draft_ids"].long()
    q, k, v = w["wqkv"].split([nq, nk, nk])
    gate, up = w["wgu"].split(cfg.ffn)
    t = {"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
         "midlayer.self_attn.v_proj.weight": v, "midlayer.mlp.gate_proj.weight": gate,
         "midlayer.mlp.up_proj.weight": up, "fc.weight": w["fc"], "norm.weight": w["norm"],
         "lm_head.weight": w["head"]}
    t |= {f"midlayer.{name}.weight": w[key] for key, name in _WRITE_LAYER.items()}
    t = {n: x.detach().half().contiguous() for n, x in t.items()}
    t["d2t"] = (ids - torch.arange(len(ids))).contiguous()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_act": "silu", "hidden_size": cfg.hidden,
              "intermediate_size": cfg.ffn, "model_type": "llama", "num_attention_heads": cfg.heads,
              "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": cfg.eps, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": vocab,
              "draft_vocab_size": len(ids)}
    if tuple(cfg.feature_layers) != (2, layers // 2, layers - 3):
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers]}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
