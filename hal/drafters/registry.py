"""Model loading and the one ``--draft`` grammar, shared by the command line and the
two-rank server (`hal.distributed.launcher`): library code, which imports nothing from the CLI.

``--draft`` is one of ``none``, ``ngram``, ``self`` / ``self:L`` (the target's first L
layers; half of them by default), ``model:<path>`` (a separate draft model), ``eagle`` /
``eagle:<path>`` (an EAGLE head: the one shipped for the model, or a folder in the published
EAGLE-1 / EAGLE-3 layout), ``ngram+eagle[:<path>]`` (n-gram lookup where it finds a match,
the head elsewhere), or the draft-tree forms ``ngram-tree`` (lookup candidates as branches),
``eagle-tree[:<path>]`` and ``ngram+eagle-tree[:<path>]`` (EAGLE-2 dynamic trees, `TREE`)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from hal.errors import HalError
from hal.models.fetch import load_model

DRAFT_GRAMMAR = ("none, ngram, ngram-tree, self[:L], model:<path>, eagle[:<path>], ngram+eagle[:<path>], "
                 "eagle-tree[:<path>] or ngram+eagle-tree[:<path>]")
HEADS = ("eagle", "ngram+eagle", "eagle-tree", "ngram+eagle-tree")   # the kinds that run an EAGLE head
TREE = (3, 4)   # EAGLE-2 trees: top-3 expansion per level, 4 levels (tau on held-out prompts: benchmarks/e2e.py)


class DraftSpec(NamedTuple):
    kind: str                 # "none", "ngram", "ngram-tree", "self", "model" or one of HEADS
    layers: int | None = None  # self: the first L layers (None: half the target's)
    path: str | None = None    # model: the draft model's path; eagle: the head's folder (None: the shipped one)


def parse_draft(spec: str, allowed: tuple[str, ...] = ("none", "ngram", "ngram-tree", "self", "model") + HEADS
                ) -> DraftSpec:
    """Parse a ``--draft`` value; `HalError` naming ``--draft`` when it is not one of ``allowed``."""
    kind, _, rest = spec.partition(":")
    expected = ", ".join(k + ("[:L]" if k == "self" else ":<path>" if k == "model" else "[:<path>]" if "eagle" in k
                              else "") for k in allowed)
    try:
        if kind in ("none", "ngram", "ngram-tree") and not rest:
            d = DraftSpec(kind)
        elif kind == "self":
            layers = int(rest) if rest else None
            if layers is not None and layers < 1:
                raise ValueError(layers)
            d = DraftSpec("self", layers)
        elif kind == "model" and rest:
            d = DraftSpec("model", path=rest)
        elif kind in HEADS:
            d = DraftSpec(kind, path=rest or None)
        else:
            raise ValueError(spec)
    except ValueError:
        raise HalError(f"--draft: expected {expected}, got {spec!r}", arg="--draft", expected=expected,
                       got=spec) from None
    if d.kind not in allowed:
        raise HalError(f"--draft: expected {expected}, got {spec!r}", arg="--draft", expected=expected, got=spec)
    return d


def draft_memory(spec: DraftSpec, model_path: str, shares_target: bool):
    """(ModelMemory of the draft model or None for n-gram/none, its weights' path)."""
    from hal.models.llama import read_config
    from hal.engine.memory import ModelMemory
    if spec.kind in ("none", "ngram", "ngram-tree") + HEADS:   # a head's KV is 1/L of the target's: in its slack
        return None, None
    if spec.kind == "self":
        cfg = read_config(model_path)
        return ModelMemory.from_config(cfg, "draft", spec.layers or cfg.layers // 2,
                                       owns_weights=not shares_target), model_path
    return ModelMemory.from_config(read_config(spec.path), "draft"), spec.path


def make_drafter(spec: DraftSpec, backend, target=None, path: str | None = None, pool=None, device=None):
    """The drafter for ``spec``: None, `NgramDrafter`, a `ModelDrafter` over the first L
    layers of ``target`` (self) or of the model at ``path`` (model, or self without a target),
    its KV in ``pool`` when given, or a `hal.drafters.eagle.HeadDrafter` for ``target`` (eagle: the head
    shipped for the model named ``path`` unless the spec names a folder)."""
    from hal.drafters import ModelDrafter, NgramDrafter, NgramTreeDrafter
    if spec.kind == "none":
        return None
    if spec.kind == "ngram":
        return NgramDrafter(backend)
    if spec.kind == "ngram-tree":
        return NgramTreeDrafter(backend)
    if spec.kind in HEADS:
        from hal.models.eagle import load_eagle, shipped_head
        from hal.drafters.eagle import HeadDrafter, NgramOrHead
        if target is None:
            raise HalError(f"--draft {spec.kind}: expected the target model in this process (an EAGLE head reads "
                           f"its features and shares its embeddings), got a separate draft rank", arg="--draft")
        head = HeadDrafter(load_eagle(spec.path or shipped_head(path or ""), target, backend, device),
                           tree=TREE if spec.kind.endswith("-tree") else None)
        return head if spec.kind.startswith("eagle") else NgramOrHead(NgramDrafter(backend, min_n=2), head)
    if target is not None and spec.kind == "self":
        model = target
    else:
        model = load_model(path, backend)[0]
        model = model.to(device) if device is not None else model
    layers = model.cfg.layers if spec.kind == "model" else (spec.layers or model.cfg.layers // 2)
    return ModelDrafter(model.layer_view(layers), pool=pool)
