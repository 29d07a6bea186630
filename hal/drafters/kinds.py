"""Model loading and the one ``--draft`` grammar, shared by the command line and the
two-rank server (`hal.launch`): library code, which imports nothing from the CLI.

``--draft`` is one of ``none``, ``ngram``, ``self`` / ``self:L`` (the target's first L
layers; half of them by default), ``model:<path>`` (a separate draft model), ``eagle`` /
``eagle:<path>`` (an EAGLE head: the one shipped for the model, or a folder in the published
EAGLE-1 / EAGLE-3 layout), ``ngram+eagle[:<path>]`` (n-gram lookup where it finds a match,
the head elsewhere), or the draft-tree forms ``ngram-tree`` (lookup candidates as branches),
``eagle-tree[:<path>]`` and ``ngram+eagle-tree[:<path>]`` (EAGLE-2 dynamic trees, `TREE`), or
``dspark[:<path>]`` / ``ngram+dspark[:<path>]`` (a DSpark block drafter, `hal.models.dspark`;
a folder in any layout `hal.models.block_layouts` reads), ``dflash:<path>`` (the same, for a
published DFlash or DSpark folder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hal.errors import HalError
from hal.models.fetch import load_model

TREE = (3, 4)   # EAGLE-2 trees: top-3 expansion per level, 4 levels (tau on held-out prompts: benchmarks/e2e.py)


@dataclass(frozen=True)
class DraftKind:
    """One ``--draft`` kind: its grammar and what it needs. The table `DRAFT_KINDS` is the only list."""

    name: str
    argument: str            # "" (none), "[:L]" (optional layer count), ":<path>" (required) or "[:<path>]"
    summary: str
    head: bool = False       # reads the target's features and shares its embeddings (an EAGLE head, a block drafter)
    tree: bool = False       # drafts trees (`TREE` for heads)
    weights: bool = False    # loads draft-model weights of its own (planned by `draft_memory`)
    cli: bool = True         # offered by ``spec-hal generate / demo / bench``
    remote: bool = True      # can run on a separate draft rank
    ahead: bool = True       # there, drafts the next round ahead of verification (`hal.distributed.speculate`;
    #                          never a tree; a head only from its own features: the chain head)

    def form(self) -> str:
        return self.name + self.argument


DRAFT_KINDS = (
    DraftKind("none", "", "plain decoding", remote=False),
    DraftKind("ngram", "", "n-gram prompt lookup (vLLM's proposer)"),
    DraftKind("ngram-tree", "", "prompt lookup's candidates as branches of one draft tree", tree=True, ahead=False),
    DraftKind("self", "[:L]", "the target's first L layers (half of them by default)", weights=True),
    DraftKind("model", ":<path>", "a separate draft model (.gguf or HF folder)", weights=True, cli=False),
    DraftKind("eagle", "[:<path>]", "an EAGLE head: the one shipped for the model, or a folder in the "
              "EAGLE-1 / EAGLE-3 layout", head=True),
    DraftKind("ngram+eagle", "[:<path>]", "n-gram lookup where it matches, the EAGLE head elsewhere", head=True,
              ahead=False),
    DraftKind("eagle-tree", "[:<path>]", "EAGLE-2 dynamic draft trees from the head", head=True, tree=True,
              ahead=False),
    DraftKind("ngram+eagle-tree", "[:<path>]", "n-gram lookup, else the head's EAGLE-2 trees", head=True, tree=True,
              ahead=False),
    DraftKind("dspark", "[:<path>]", "a DSpark block drafter (one forward per block, confidence-scheduled "
              "verification): the one shipped for the model, or a folder", head=True, ahead=False),
    DraftKind("ngram+dspark", "[:<path>]", "n-gram lookup where it matches, the block drafter elsewhere", head=True,
              ahead=False),
    DraftKind("dflash", ":<path>", "a published block drafter folder, its layout read from config.json (z-lab's "
              "DFlashDraftModel, DeepSpec's Qwen3DSparkModel; dspark:<path> reads the same)", head=True, ahead=False),
)
BLOCK = ("dspark", "ngram+dspark", "dflash")   # the block drafter's kinds (`hal.models.block_layouts`)
KINDS = {kind.name: kind for kind in DRAFT_KINDS}
HEADS = tuple(kind.name for kind in DRAFT_KINDS if kind.head)   # the kinds that read the target's features


def draft_kinds(*, cli: bool = False, remote: bool = False) -> tuple[str, ...]:
    """The kind names offered where the CLI (``cli``) or a separate draft rank (``remote``) runs."""
    return tuple(k.name for k in DRAFT_KINDS if (k.cli or not cli) and (k.remote or not remote))


def draft_help(allowed: tuple[str, ...] | None = None) -> str:
    """``--draft``'s help text from the table."""
    return "; ".join(f"{k.form()}: {k.summary}" for k in DRAFT_KINDS if allowed is None or k.name in allowed)


class DraftSpec(NamedTuple):
    kind: str                 # a `DRAFT_KINDS` name
    layers: int | None = None  # self: the first L layers (None: half the target's)
    path: str | None = None    # model: the draft model's path; eagle: the head's folder (None: the shipped one)


def parse_draft(spec: str, allowed: tuple[str, ...] | None = None) -> DraftSpec:
    """Parse a ``--draft`` value; `HalError` naming ``--draft`` when it is not one of ``allowed``
    (default: every kind)."""
    allowed = tuple(KINDS) if allowed is None else allowed
    name, colon, rest = spec.partition(":")
    expected = ", ".join(KINDS[k].form() for k in allowed if k in KINDS)
    kind = KINDS.get(name)
    bad = HalError(f"--draft: expected {expected}, got {spec!r}", arg="--draft", expected=expected, got=spec)
    if kind is None or name not in allowed:
        raise bad
    if kind.argument == "" and colon or kind.argument == ":<path>" and not rest:
        raise bad
    if kind.argument == "[:L]":
        if not rest:
            return DraftSpec(name)
        if not rest.isdigit() or int(rest) < 1:
            raise HalError(f"--draft: expected {name}:L with L a number of the target's layers >= 1 (or {name} "
                           f"alone: half of them), got {spec!r}", arg="--draft", expected=f"{name}:L, L >= 1", got=spec)
        return DraftSpec(name, int(rest))
    return DraftSpec(name, path=rest or None)


def draft_memory(spec: DraftSpec, model_path: str, shares_target: bool):
    """(ModelMemory of the draft model or None for n-gram/none, its weights' path)."""
    from hal.models.loaders import read_config
    from hal.engine.memory import ModelMemory
    if not KINDS[spec.kind].weights:   # n-gram, none; a head's KV is 1/L of the target's: in its slack
        return None, None
    if spec.kind == "self":
        cfg = read_config(model_path)
        return ModelMemory.from_config(cfg, "draft", spec.layers or cfg.layers // 2,
                                       owns_weights=not shares_target), model_path
    return ModelMemory.from_config(read_config(spec.path), "draft"), spec.path


def feature_layers(spec: DraftSpec, model: str, target_layers: int) -> tuple[int, ...] | None:
    """The target layers a feature-reading kind taps (``()``: the final normed hidden state), read
    from its folder without loading its weights (a target rank whose drafter runs elsewhere);
    None for kinds that read no features."""
    if not KINDS[spec.kind].head:
        return None
    if spec.kind in BLOCK:
        from hal.models.block_layouts import read_config
        from hal.models.dspark import shipped_block
        return read_config(spec.path or shipped_block(model)).taps
    from hal.models.eagle import shipped_head
    from hal.models.eagle_layouts import head_feature_layers
    return head_feature_layers(spec.path or shipped_head(model), target_layers)


def same_vocabulary(draft_path: str, draft, draft_tok, target_vocab: int, target_tok) -> None:
    """`HalError` naming ``--draft`` unless a draft model's vocabulary is the target's: the
    same size and, where both have tokenizers, the same token at every id (drafts are token
    ids: another vocabulary's would be verified as different tokens)."""
    if draft.cfg.vocab != target_vocab:
        raise HalError(f"--draft: expected a draft model with the target's vocabulary ({target_vocab} tokens), got "
                       f"{draft_path} with {draft.cfg.vocab}", arg="--draft")
    if draft_tok is None or target_tok is None:
        return
    mine, theirs = draft_tok.get_vocab(with_added_tokens=True), target_tok.get_vocab(with_added_tokens=True)
    at = {i: t for t, i in mine.items()}
    for t, i in sorted(theirs.items(), key=lambda kv: kv[1]):
        if at.get(i) != t:
            raise HalError(f"--draft: expected a draft model with the target's vocabulary, got {draft_path}, whose "
                           f"token {i} is {at.get(i)!r} where the target's is {t!r}", arg="--draft")


def make_drafter(spec: DraftSpec, backend, target=None, path: str | None = None, pool=None, device=None,
                 vocabulary: tuple[int, object] | None = None):
    """The drafter for ``spec``: None, `NgramDrafter`, a `ModelDrafter` over the first L
    layers of ``target`` (self) or of the model at ``path`` (model, or self without a target;
    refused unless its vocabulary is ``vocabulary``: the target's size and tokenizer, `same_vocabulary`),
    its KV in ``pool`` when given, or a `hal.drafters.eagle.EagleDrafter` for ``target`` (eagle: the head
    shipped for the model named ``path`` unless the spec names a folder)."""
    from hal.drafters import ModelDrafter, NgramDrafter, NgramTreeDrafter
    if spec.kind == "none":
        return None
    if spec.kind == "ngram":
        return NgramDrafter(backend)
    if spec.kind == "ngram-tree":
        return NgramTreeDrafter(backend)
    if spec.kind in BLOCK:
        from hal.drafters.dflash import DFlashDrafter
        from hal.drafters.dspark import DSparkDrafter
        from hal.drafters.eagle import NgramOrHead
        from hal.models.block_layouts import load_block
        from hal.models.dspark import Confidence, shipped_block
        if target is None:
            raise HalError(f"--draft {spec.kind}: expected the target model in this process (a block drafter shares "
                           f"its embeddings and lm_head), got a separate draft rank", arg="--draft")
        model = load_block(spec.path or shipped_block(path or ""), target, backend, device)
        plain = not model.cfg.rank and model.cfg.confidence == Confidence.NONE   # DFlash: no Markov, no confidence
        block = (DFlashDrafter if plain else DSparkDrafter)(model)
        return block if spec.kind != "ngram+dspark" else NgramOrHead(NgramDrafter(backend, min_n=2), block)
    if KINDS[spec.kind].head:
        from hal.models.eagle import shipped_head
        from hal.models.eagle_layouts import load_eagle
        from hal.drafters.eagle import EagleDrafter, NgramOrHead
        if target is None:
            raise HalError(f"--draft {spec.kind}: expected the target model in this process (an EAGLE head reads "
                           f"its features and shares its embeddings), got a separate draft rank", arg="--draft")
        head = EagleDrafter(load_eagle(spec.path or shipped_head(path or ""), target, backend, device),
                           tree=TREE if KINDS[spec.kind].tree else None)
        return head if spec.kind.startswith("eagle") else NgramOrHead(NgramDrafter(backend, min_n=2), head)
    if target is not None and spec.kind == "self":
        model = target
    else:
        model, tok = load_model(path, backend)
        if vocabulary is not None:
            same_vocabulary(path, model, tok, *vocabulary)
        model = model.to(device) if device is not None else model
    layers = model.cfg.layers if spec.kind == "model" else (spec.layers or model.cfg.layers // 2)
    return ModelDrafter(model.layer_view(layers), pool=pool)
