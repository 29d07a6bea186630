"""An HF folder as transformers reads it: ``config.json`` (the family's differences become
`hal.models.llama.LlamaConfig` fields), ``model.safetensors`` or its shards
(``model.safetensors.index.json``), ``tokenizer.json`` (the ``tokenizers`` library loads it as
it is) and ``generation_config.json`` (its ``eos_token_id``, one id or a list: Llama 3 stops on
``<|eot_id|>`` and ``<|end_of_text|>``).

The families (``model_type``), as transformers defines them:

* ``llama``: ``attention_bias`` puts biases on q, k, v and o; ``rope_scaling`` / ``rope_parameters``
  of type ``llama3`` (Llama 3.1+) is applied; tied or untied heads;
* ``mistral``: a ``sliding_window``: contexts within it run (full attention is exactly the window
  there), a longer one is refused;
* ``qwen2``: biases on q, k and v (not o); its sliding window only with ``use_sliding_window``;
* ``qwen3``: ``attention_bias`` as Llama's, and per-head RMSNorm of q and k before RoPE;
* ``phi3``: Llama's layer with q, k, v in one ``qkv_proj`` and gate and up in one ``gate_up_proj``
  (split here into the runner's parts); a ``sliding_window`` as Mistral's; longrope scaling and a
  partial rotary factor are refused.

What transformers 5 writes (``rope_parameters``) and what earlier versions wrote (``rope_theta``,
``rope_scaling``) are both read. Every weight is checked against the config's shapes, and a
tensor the config does not explain is refused, naming the file: never a silently wrong model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hal.errors import HalError
from hal.models.llama import LlamaConfig


@dataclass(frozen=True)
class Family:
    """What a ``model_type`` adds to the Llama layer (transformers' modeling code)."""

    qkv_bias: bool | None   # None: the config's attention_bias (then o has one too)
    qk_norm: bool = False
    sliding: str | None = None   # the config key that turns its sliding window on (None: always on if set)


FAMILIES = {"llama": Family(None), "mistral": Family(False), "qwen2": Family(True, sliding="use_sliding_window"),
            "qwen3": Family(None, qk_norm=True, sliding="use_sliding_window"), "phi3": Family(False)}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}
ROPE_TYPES = ("default", "llama3")

# HF tensor names in a layer -> the runner's (biases and q/k norms where the family has them)
LAYER_NAMES = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
               "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
               "self_attn.o_proj.weight": "wo", "mlp.gate_proj.weight": "wgate", "mlp.up_proj.weight": "wup",
               "mlp.down_proj.weight": "wdown", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
               "self_attn.v_proj.bias": "bv", "self_attn.o_proj.bias": "bo", "self_attn.q_norm.weight": "q_norm",
               "self_attn.k_norm.weight": "k_norm"}
FUSED = {"self_attn.qkv_proj.weight": ("wq", "wk", "wv"), "mlp.gate_up_proj.weight": ("wgate", "wup")}   # Phi-3's
IGNORED = ("rotary_emb.inv_freq",)   # buffers some checkpoints carry; recomputed


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path`` (a config file), or a `HalError` naming the file and ``what``."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise HalError(f"{path}: expected {what}, got no such file") from None
    except (OSError, ValueError) as e:
        raise HalError(f"{path}: expected {what} (JSON), got unreadable text ({e})") from None
    if not isinstance(value, dict):
        raise HalError(f"{path}: expected {what} (a JSON object), got {type(value).__name__}")
    return value


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _rope(c: dict, where: Path) -> tuple[float, dict | None]:
    """(theta, scaling or None) from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier); a scaling type the runner does not apply is refused."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = c.get("rope_theta", 10000.0), c.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HalError(f"{where}: expected rope scaling of type {' or '.join(ROPE_TYPES)}, got {kind!r}")
    return float(theta), (dict(scaling) if kind != "default" else None)


def read_hf_config(folder: str | Path) -> LlamaConfig:
    """The `LlamaConfig` of an HF folder (config.json, and generation_config.json's stop ids)."""
    folder = Path(folder)
    where = folder / "config.json"
    c = read_json(where, "a transformers config.json")
    kind = c.get("model_type") or ARCHITECTURES.get((c.get("architectures") or [None])[0])
    if kind not in FAMILIES:
        raise HalError(f"{where}: expected model_type one of {', '.join(FAMILIES)} (architectures "
                       f"{', '.join(ARCHITECTURES)}), got {kind!r} ({c.get('architectures')})")
    fam = FAMILIES[kind]
    if c.get("mlp_bias"):
        raise HalError(f"{where}: expected mlp_bias false (no family here has MLP biases), got true")
    rotary = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if rotary not in (None, 1, 1.0):
        raise HalError(f"{where}: expected partial_rotary_factor 1.0 (RoPE over the whole head), got {rotary}")
    try:
        heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
        theta, scaling = _rope(c, where)
        window = c.get("sliding_window") if fam.sliding is None or c.get(fam.sliding) else None
        bias = bool(c.get("attention_bias", False)) if fam.qkv_bias is None else fam.qkv_bias
        gen = folder / "generation_config.json"
        eos = _ids(read_json(gen, "a generation config").get("eos_token_id")) if gen.is_file() else ()
        eos = eos or _ids(c.get("eos_token_id"))
        return LlamaConfig(hidden=hidden, layers=int(c["num_hidden_layers"]), heads=heads,
                           kv_heads=int(c.get("num_key_value_heads") or heads),
                           head_dim=int(c.get("head_dim") or hidden // heads), ffn=int(c["intermediate_size"]),
                           vocab=int(c["vocab_size"]), rope_base=theta, eps=float(c.get("rms_norm_eps", 1e-6)),
                           rope_interleaved=False, bos_id=c.get("bos_token_id"), eos_id=eos[0] if eos else None,
                           max_context=c.get("max_position_embeddings"), family=kind,
                           qkv_bias=bias, o_bias=bias and fam.qkv_bias is None, qk_norm=fam.qk_norm,
                           rope_scaling=scaling, sliding_window=int(window) if window else None, eos_ids=eos,
                           tied_head=bool(c.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise HalError(f"{where}: expected the key {e.args[0]!r} ({kind}), got none") from None
    except (TypeError, ValueError) as e:
        raise HalError(f"{where}: expected numbers in the {kind} config, got {e}") from None


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The runner's name -> shape for every tensor the config implies (the head when untied)."""
    H, D, nq, nk = cfg.hidden, cfg.head_dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {"embed": (cfg.vocab, H), "norm": (H,)}
    for i in range(cfg.layers):
        layer = {"attn_norm": (H,), "ffn_norm": (H,), "wq": (nq, H), "wk": (nk, H), "wv": (nk, H), "wo": (H, nq),
                 "wgate": (cfg.ffn, H), "wup": (cfg.ffn, H), "wdown": (H, cfg.ffn)}
        if cfg.qkv_bias:
            layer.update(bq=(nq,), bk=(nk,), bv=(nk,))
        if cfg.o_bias:
            layer["bo"] = (H,)
        if cfg.qk_norm:
            layer.update(q_norm=(D,), k_norm=(D,))
        out.update({f"{i}.{k}": s for k, s in layer.items()})
    return out


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files: the index's shards, else every ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index, "a safetensors index").get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if not shards or missing:
            raise HalError(f"{index}: expected its shards beside it, got {missing or 'an empty weight_map'} missing")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HalError(f"{folder}: expected model.safetensors (or shards with model.safetensors.index.json), got none")
    return files


def read_hf_weights(folder: str | Path, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every weight of ``folder`` under the runner's names, float32, each checked against the config."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    folder, want = Path(folder), expected_shapes(cfg)
    w = {}
    for file in weight_files(folder):
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise HalError(f"{file}: expected a safetensors file, got one that does not load ({e})") from None
        for name, t in tensors.items():
            if name == "model.embed_tokens.weight":
                ours = "embed"
            elif name == "model.norm.weight":
                ours = "norm"
            elif name == "lm_head.weight":
                ours = "head"
            elif name.startswith("model.layers.") and name.count(".") >= 3:
                _, _, i, rest = name.split(".", 3)
                ours = f"{i}.{LAYER_NAMES[rest]}" if rest in LAYER_NAMES else None
                if rest in IGNORED:
                    continue
                if rest in FUSED and cfg.family == "phi3":   # split into the parts, each checked below
                    parts = [f"{i}.{p}" for p in FUSED[rest]]
                    rows = [want[p][0] for p in parts]
                    if tuple(t.shape) != (sum(rows), cfg.hidden):
                        raise HalError(f"{file}: expected {name} of shape {[sum(rows), cfg.hidden]} (config.json), "
                                       f"got {list(t.shape)}")
                    w.update(zip(parts, (x.float() for x in t.split(rows))))
                    continue
            else:
                ours = None
            shape = want.get(ours, (cfg.vocab, cfg.hidden) if ours == "head" else None)
            if shape is None:
                raise HalError(f"{file}: expected only the tensors of a {cfg.family} model as config.json describes "
                               f"it, got {name} {list(t.shape)}")
            if tuple(t.shape) != shape:
                raise HalError(f"{file}: expected {name} of shape {list(shape)} (config.json), got {list(t.shape)}")
            w[ours] = t.float()
    if "head" not in w and not cfg.tied_head:
        raise HalError(f"{folder}: expected lm_head.weight (config.json: tie_word_embeddings false), got none")
    missing = [k for k in want if k not in w]
    if missing:
        raise HalError(f"{folder}: expected every tensor config.json implies, got {len(missing)} missing "
                       f"(the runner's names: {missing[:4]})")
    return w


def hf_tokenizer(folder: str | Path):
    """``tokenizer.json`` as the ``tokenizers`` library loads it, or None when the folder has none."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:   # the library raises plain Exception for a malformed file
        raise HalError(f"{path}: expected a tokenizers JSON file, got one that does not load ({e})") from None
