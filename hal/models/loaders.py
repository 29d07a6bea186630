"""Loading a Llama: from a GGUF file (weights stored as Q4_0/Q4_1 blocks kept as int4 where
the plan runs them so, layers' and an lm_head's Q8_0 blocks kept so where the plan runs them
so, the rest dequantized with ``gguf``) or an HF folder (config.json + safetensors); the config
alone (`read_config`), which linears a file stores in each form that runs as stored
(`stored_masks`), and whether its lm_head is Q8_0 or Q6_K (`head_q8`)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hal.errors import HalError
from hal.models import int4, k_quants, q4_rows
from hal.models.gguf_file import GGUFFile, open_gguf
from hal.models.hf import read_hf_config, read_hf_weights
from hal.models.tokenizer import PRE
from hal.models.linear_layout import STORED, LinearPlan
from hal.models.linear_plan import choose_plan, pin_head
from hal.models.llama import LINEAR_KEYS, Llama, LlamaConfig, _fuse, linear_shapes


GGUF_NAMES = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
              "attn_output": "wo", "ffn_gate": "wgate", "ffn_up": "wup", "ffn_down": "wdown"}
FUSED_PARTS = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "wgu": ("ffn_gate", "ffn_up"),
               "wdown": ("ffn_down",)}   # each linear the forward runs, from the file's tensors


def _int4_tensors(tensors, layers: int, kinds=tuple(int4.BLOCK_BYTES)) -> set[str]:
    """The names of the file's tensors that can run as stored: every part of a fused linear
    is of one of ``kinds`` (default Q4_0/Q4_1; ``("Q8_0",)`` / ``("Q6_K",)``: the q4q8 kernel's Q8 / Q6 tiles), and
    the fused shape fits the kernel (`hal.models.int4.fits`)."""
    types = {t.name: t.kind for t in tensors}
    shapes = {t.name: t.shape for t in tensors}
    out = set()
    for i in range(layers):
        for parts in FUSED_PARTS.values():
            names = [f"blk.{i}.{p}.weight" for p in parts]
            if all(types.get(n) in kinds for n in names) and int4.fits(
                    sum(shapes[n][0] for n in names), shapes[names[0]][1]):
                out.update(names)
    return out


def _mask(stored: set[str], layers: int) -> list[bool]:
    return [f"blk.{i}.{FUSED_PARTS[k][0]}.weight" in stored for i in range(layers) for k in LINEAR_KEYS] + [False]


def _stored(tensors, layers: int) -> dict[str, set[str]]:
    """The file's tensors that can run as stored, by the plan's argument that names their form
    (a fused linear of K-quant parts may mix types: a Q4_K_M file's attn_v in Q6_K beside Q4_K q
    and k, or, where rows are not multiples of 256, Q5_0 parts beside a Q8_0 one)."""
    q6, q8 = _int4_tensors(tensors, layers, ("Q6_K",)), _int4_tensors(tensors, layers, ("Q8_0",))
    return {"stored_int4": _int4_tensors(tensors, layers), "stored_q8": q8, "stored_q6": q6,
            "stored_q4k": _int4_tensors(tensors, layers, tuple(k_quants.READERS)) - q6 - q8}


def stored_masks(path: str | Path, cfg: LlamaConfig) -> dict[str, list[bool]]:
    """Which of `linear_shapes` ``path`` stores in each form `choose_plan` takes (an HF folder: none)."""
    path = Path(path)
    if path.is_dir():
        return {}
    return {k: _mask(v, cfg.layers) for k, v in _stored(model_file(path).tensors, cfg.layers).items()}


def _head(tensors):
    """The file's lm_head tensor: ``output.weight``, else the tied embedding."""
    by_name = {t.name: t for t in tensors}
    return by_name.get("output.weight", by_name.get("token_embd.weight"))


def head_q8(path: str | Path, kind: str = "Q8_0") -> bool:
    """Whether ``path`` stores its lm_head as ``kind`` (Q8_0 or Q6_K) blocks (an HF folder: no)."""
    path = Path(path)
    return not path.is_dir() and getattr(_head(model_file(path).tensors), "kind", None) == kind


@dataclass(frozen=True)
class GGUFFamily:
    """What an architecture's GGUF differs in, as llama.cpp's converter writes it."""

    interleaved: bool        # q/k rows permuted for adjacent-pair RoPE (llama); NEOX order otherwise
    qkv_bias: bool = False   # attn_q/k/v.bias always there (Qwen2); else only where the file has them
    qk_norm: bool = False    # attn_q_norm / attn_k_norm (Qwen3)


GGUF_FAMILIES = {"llama": GGUFFamily(True), "qwen2": GGUFFamily(False, qkv_bias=True),
                 "qwen3": GGUFFamily(False, qk_norm=True), "phi3": GGUFFamily(False)}
FUSED_GGUF = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}   # phi3's, by rows
GGUF_PRE = tuple(PRE)   # the pre-tokenizers `hal.models.tokenizer.from_gguf_fields` builds as their tokenizer.json
REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
K_QUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")   # a file with any of these runs rows of one code


def _gguf_config(r: GGUFFile) -> LlamaConfig:
    f = r.field
    arch = f("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise HalError(f"{r.path}: expected a GGUF of architecture {', '.join(GGUF_FAMILIES)}, got {arch!r}",
                       arg="model")
    fam, names = GGUF_FAMILIES[arch], {t.name for t in r.tensors}
    missing = [f"{arch}.{k}" for k in REQUIRED if f(f"{arch}.{k}") is None]
    missing += ["tokenizer.ggml.tokens"] if f("tokenizer.ggml.tokens") is None else []
    if missing:
        raise HalError(f"{r.path}: expected the metadata keys {', '.join(missing)}, got none", arg="model")
    heads, hidden = f(f"{arch}.attention.head_count"), f(f"{arch}.embedding_length")
    bias = fam.qkv_bias or "blk.0.attn_q.bias" in names
    if bias and fam.interleaved:
        raise HalError(f"{r.path}: expected a llama GGUF without attention biases (not supported here), got "
                       f"blk.0.attn_q.bias", arg="model")
    head_dim = f(f"{arch}.attention.key_length") or hidden // heads
    if f(f"{arch}.rope.dimension_count") not in (None, head_dim):   # Phi-4-mini's partial rotary, say
        raise HalError(f"{r.path}: expected {arch}.rope.dimension_count {head_dim} (RoPE over the whole head), got "
                       f"{f(f'{arch}.rope.dimension_count')}", arg="model")
    factors = None
    if "rope_freqs.weight" in names:   # llama3 RoPE scaling, as the converter precomputes it
        t = next(t for t in r.tensors if t.name == "rope_freqs.weight")
        if t.kind != "F32" or t.shape != [head_dim // 2]:
            raise HalError(f"{r.path}: expected rope_freqs.weight F32 [{head_dim // 2}], got {t.kind} {t.shape}",
                           arg="model")
        factors = tuple(float(x) for x in r.data(t))
    return LlamaConfig(hidden=hidden, layers=f(f"{arch}.block_count"), heads=heads,
                       kv_heads=f(f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
                       ffn=f(f"{arch}.feed_forward_length"), vocab=len(f("tokenizer.ggml.tokens")),
                       rope_base=float(f(f"{arch}.rope.freq_base", 10000.0)),
                       eps=float(f(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                       rope_interleaved=fam.interleaved, bos_id=f("tokenizer.ggml.bos_token_id"),
                       eos_id=f("tokenizer.ggml.eos_token_id"), max_context=f(f"{arch}.context_length"), family=arch,
                       qkv_bias=bias, o_bias="blk.0.attn_output.bias" in names, qk_norm=fam.qk_norm,
                       rope_factors=factors, eos_ids=_gguf_stops(f),
                       sliding_window=f(f"{arch}.attention.sliding_window") or None)


def model_file(path: str | Path) -> GGUFFile:
    """``path`` as `open_gguf` reads it, with phi3's fused tensors (``attn_qkv``, ``ffn_up`` of
    gate and up) seen as their parts: row ranges of the same bytes (a quantized row is whole
    blocks), so each part loads, and runs as stored, as another family's does."""
    from dataclasses import replace
    r = open_gguf(path)
    if r.field("general.architecture") != "phi3":
        return r
    cfg = _gguf_config(r)
    nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    rows = {"attn_qkv": (nq, nk, nk), "ffn_up": (cfg.ffn, cfg.ffn)}
    out = []
    for t in r.tensors:
        p = t.name.split(".")
        fused = len(p) == 4 and p[0] == "blk" and p[3] == "weight" and p[2] in rows and len(t.dims) == 2 \
            and t.dims[1] == sum(rows[p[2]]) and t.nbytes % t.dims[1] == 0
        if not fused:
            out.append(t)
            continue
        per_row, at = t.nbytes // t.dims[1], t.offset
        for part, n in zip(FUSED_GGUF[p[2]], rows[p[2]]):
            out.append(replace(t, name=f"blk.{p[1]}.{part}.weight", dims=(t.dims[0], n), offset=at, nbytes=n * per_row))
            at += n * per_row
    return replace(r, tensors=out)


def _gguf_stops(f) -> tuple[int, ...]:
    """The stop ids: eos, then eot and eom where the file names them (Llama 3 ends a turn with eot)."""
    ids = [f(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


GGUF_EXTRAS = {"attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv", "attn_output.bias": "bo",
               "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}


def _check_gguf(r: GGUFFile, cfg: LlamaConfig) -> None:
    """`HalError` naming the file, before any tensor is read: the tokenizer is one built exactly
    here (BPE with merges, a known pre-tokenizer), and the tensor table is what the config
    implies (every tensor, its shape; the embedding has a row per token), nothing else."""
    f = r.field
    if f("tokenizer.ggml.model") not in (None, "gpt2", "llama"):
        raise HalError(f"{r.path}: expected tokenizer.ggml.model 'gpt2' (byte-level BPE) or 'llama' (SentencePiece), "
                       f"got {f('tokenizer.ggml.model')!r}", arg="model")
    spm = f("tokenizer.ggml.model") == "llama"
    if not spm and not f("tokenizer.ggml.merges"):
        raise HalError(f"{r.path}: expected tokenizer.ggml.merges (a BPE tokenizer's merges), got none", arg="model")
    if not spm and f("tokenizer.ggml.pre") not in (None, *GGUF_PRE):
        raise HalError(f"{r.path}: expected tokenizer.ggml.pre one of {', '.join(GGUF_PRE)} (tokenized exactly as "
                       f"their tokenizer.json does), got {f('tokenizer.ggml.pre')!r}", arg="model")
    H, D, nq, nk = cfg.hidden, cfg.head_dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    want = {"token_embd.weight": [cfg.vocab, H], "output_norm.weight": [H]}
    if cfg.rope_factors is not None:
        want["rope_freqs.weight"] = [D // 2]
    for i in range(cfg.layers):
        layer = [("attn_norm.weight", [H]), ("ffn_norm.weight", [H]), ("attn_q.weight", [nq, H]),
                 ("attn_k.weight", [nk, H]), ("attn_v.weight", [nk, H]), ("attn_output.weight", [H, nq]),
                 ("ffn_gate.weight", [cfg.ffn, H]), ("ffn_up.weight", [cfg.ffn, H]), ("ffn_down.weight", [H, cfg.ffn])]
        layer += [("attn_q.bias", [nq]), ("attn_k.bias", [nk]), ("attn_v.bias", [nk])] if cfg.qkv_bias else []
        layer += [("attn_output.bias", [H])] if cfg.o_bias else []
        layer += [("attn_q_norm.weight", [D]), ("attn_k_norm.weight", [D])] if cfg.qk_norm else []
        want.update({f"blk.{i}.{k}": s for k, s in layer})
    have = {t.name: t.shape for t in r.tensors}
    for name, shape in have.items():
        expected = [cfg.vocab, H] if name == "output.weight" else want.get(name)
        if expected is None:
            raise HalError(f"{r.path}: expected only the tensors of a {cfg.family} model, got {name} {shape} (not "
                           f"supported here)", arg="model")
        if shape != expected:
            raise HalError(f"{r.path}: expected {name} of shape {expected} (its metadata: {cfg.vocab} tokens), got "
                           f"{shape}", arg="model")
    missing = [n for n in want if n not in have]
    if missing:
        raise HalError(f"{r.path}: expected every tensor its metadata implies, got {len(missing)} missing "
                       f"({', '.join(missing[:3])})", arg="model")


def read_config(path: str | Path) -> LlamaConfig:
    """The config of a GGUF file or an HF folder, without loading any weights."""
    path = Path(path)
    if path.is_dir():
        return read_hf_config(path)
    return _gguf_config(open_gguf(path))


def load_gguf(path: str | Path, backend, dtype: str = "float32", plan_refresh: bool = False,
              plan: LinearPlan | None = None, lm_head: str = "auto", row_codes: int | None = None):
    """(Llama, tokenizer) from a llama-architecture GGUF file. ``plan`` (None: measured for
    ``dtype`` on this machine, `hal.models.linear_plan.choose_plan`, its lm_head's form as
    ``lm_head`` pins it, `hal.models.linear_plan.pin_head`) says how the linear
    layers run: weights stored as Q4_0/Q4_1 blocks stay int4 as stored when it runs them so
    (no float copy is kept; int4pack's form or q4q8 tiles), Q8_0 and K-quant blocks run as q4q8
    tiles under a q4q8 plan, and a Q8_0 or Q6_K lm_head is packed as stored when the plan's
    ``head`` names it (the float rows stay for the embedding lookup and the drafters);
    every other weight is dequantized to fp32, then cast to the plan's dtype (`Llama`).
    ``row_codes`` (None: `file_row_codes`) sets how a q4q8 plan quantizes rows: 1 or 2 int8
    codes per input (`LinearPlan.codes`)."""
    r, cfg, tok = _opened(path)
    sets = _stored(r.tensors, cfg.layers)
    head = _head(r.tensors)
    head_kind = getattr(head, "kind", None)
    choice = None
    if plan is None:
        choice = choose_plan(linear_shapes(cfg), dtype, refresh=plan_refresh, device=torch.device(backend.device_type),
                             q8_head=head_kind == "Q8_0", q6k_head=head_kind == "Q6_K",
                             **{k: _mask(v, cfg.layers) for k, v in sets.items()})
        plan = pin_head(choice, lm_head)
    plan = coded_plan(plan, r.tensors, "auto" if row_codes is None else str(row_codes))
    if plan.head != "float" and head_kind != plan.head.upper():   # refused before anything is read
        raise HalError(f"plan: expected a file whose lm_head is {plan.head.upper()} for {plan.describe()}, got {head_kind}",
                       arg="plan")
    w, forms = {}, collections.Counter()   # (type, how it runs) -> tensors: the start-up line
    for t in r.tensors:
        arr, how = _tensor(path, r, t, plan, sets)
        forms[t.kind, how] += 1
        parts = t.name.split(".")
        if parts[0] == "blk":
            rest = ".".join(parts[2:])
            w[f"{parts[1]}.{GGUF_EXTRAS[rest] if rest in GGUF_EXTRAS else GGUF_NAMES[parts[2]]}"] = arr
        elif parts[0] != "rope_freqs":   # read into the config
            w[{"token_embd": "embed", "output_norm": "norm", "output": "head"}[parts[0]]] = arr
    fused = _fuse(w, cfg.layers, plan.dtype, plan.weights)
    if plan.head != "float":
        fused["head_stored"] = _stored_head(r, head, plan)
    model = Llama(cfg, fused, backend, plan=plan)
    model.plan_choice = choice
    model.tensor_forms = "; ".join(f"{n} {kind} {how}" for (kind, how), n in sorted(forms.items())) + (
        f"; the lm_head {plan.head.upper()} as stored" if plan.head != "float" else "") + (
        f"; rows quantized per 32 to {q4_rows.ROW_WORDS[plan.codes]}" if plan.weights == "q4q8" else "")
    return model, tok


def file_row_codes(tensors) -> int:
    """The int8 codes per input a q4q8 plan quantizes a file's rows to: one (llama.cpp's int8
    rows, half the integer work of a verify's rows) where any tensor is a K-quant, as llama.cpp
    runs such a file; else two (value and residual: about 15 bits a row), the form the legacy
    Q4_0/Q4_1/Q8_0 files have always run in here."""
    return 1 if any(t.kind in K_QUANT_TYPES for t in tensors) else 2


def coded_plan(plan: LinearPlan, tensors, row_codes: str = "auto") -> LinearPlan:
    """``plan`` with its rows' codes for a file of ``tensors`` (a q4q8 plan: ``row_codes``, or by
    `file_row_codes` where ``auto``; other plans unchanged)."""
    if plan.weights != "q4q8":
        return plan
    return replace(plan, codes=file_row_codes(tensors) if row_codes == "auto" else int(row_codes))


def _opened(path):
    """(reader, config, tokenizer) of a GGUF file, each checked before any tensor is read."""
    from hal.models.tokenizer import from_gguf_fields
    r = model_file(path)
    cfg = _gguf_config(r)
    _check_gguf(r, cfg)
    try:
        tok = from_gguf_fields(r.fields)
    except HalError as e:
        raise HalError(f"{path}: {e}", arg="model") from None
    except Exception as e:   # the tokenizers library raises plain Exception for a vocabulary it refuses
        raise HalError(f"{path}: expected a BPE vocabulary and merges tokenizers accepts, got one it refuses ({e})",
                       arg="model") from None
    return r, cfg, tok


def _tensor(path, r, t, plan: LinearPlan, sets: dict[str, set[str]]):
    """(tensor ``t`` as the plan runs it, how: the start-up line's words): int4 blocks, q4q8
    tiles' codes, or floats; a `HalError` naming it where its values are not finite."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    shape, data = t.shape, r.data(t)
    if plan.weights in STORED and t.name in sets["stored_int4"]:
        return int4.from_blocks(data, t.kind, tuple(shape)), \
            f"as stored, {'Q4 tiles' if plan.weights == 'q4q8' else 'int4pack'}"
    if plan.weights == "q4q8" and any(t.name in sets[k] for k in ("stored_q8", "stored_q6", "stored_q4k")):
        read, tiles = k_quants.READERS[t.kind]   # Q8 / Q6 / Q4K / Q5 / Q5K tiles once fused (`_fuse`)
        try:
            return read(data, tuple(shape)), f"as stored, {tiles} tiles"
        except HalError as e:   # before anything runs: nothing is half-loaded
            raise HalError(f"{path}: tensor {t.name} ({t.kind}): {e}", arg="model") from None
    dt = str(plan.dtype).removeprefix("torch.")
    how = "float32" if t.kind == "F32" else "dequantized, the embedding lookup's" \
        if t.name == "token_embd.weight" else f"dequantized to {'float32' if len(shape) == 1 else dt}"
    try:
        arr = torch.from_numpy(dequantize(data, GGMLQuantizationType[t.kind]).reshape(shape).copy()).float()
    except (NotImplementedError, KeyError, ValueError) as e:
        raise HalError(f"{path}: expected tensors of a type gguf can dequantize, got {t.name} of type "
                       f"{t.kind} ({type(e).__name__}: {e})", arg="model") from None
    if not torch.isfinite(arr).all():   # a NaN or inf scale or value: every product it touches would be
        raise HalError(f"{path}: tensor {t.name} ({t.kind}): expected finite values, got "
                       f"{int((~torch.isfinite(arr)).sum())} that are not", arg="model")
    return arr, how


def _stored_head(r, head, plan: LinearPlan):
    """The lm_head's blocks in the plan's stored form: Q6 or Q8 tiles (q4q8), or two int4 halves."""
    data, shape = r.data(head), tuple(head.shape)
    if plan.head == "q6_k":
        return k_quants.from_q6_k(data, shape, plan.dtype)
    if plan.weights == "q4q8":
        return q4_rows.from_q8_0(data, shape, plan.dtype)
    return int4.from_q8_0(data, shape).pack(plan.dtype, repeat=2)


def load_safetensors(folder: str | Path, backend, dtype: str = "float32", plan_refresh: bool = False,
                     plan: LinearPlan | None = None) -> Llama:
    """A model from an HF folder (`hal.models.hf`: the family from config.json, every weight
    checked against it), rotate-half RoPE."""
    cfg = read_hf_config(folder)
    w = read_hf_weights(folder, cfg)
    return Llama(cfg, _fuse(w, cfg.layers), backend, dtype=dtype, plan_refresh=plan_refresh, plan=plan)
