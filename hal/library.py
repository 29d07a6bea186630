"""A backend's ops as ``torch.library`` custom ops (``<namespace>::<op>``), with the op
contract's fake (meta) kernels and mutated arguments, so ``torch.compile`` (fullgraph) and
graph capture treat each op as one opaque call. The fakes follow `hal.ops.Ops`: they are
the same for every backend."""

from __future__ import annotations

from types import SimpleNamespace

import torch

I32 = dict(dtype=torch.int32)
MUTATES = {"write_kv": ("k_cache", "v_cache"), "copy_kv": ("k_cache", "v_cache")}


def _verify(ids, cu, max_k):
    R = cu.shape[0] - 1
    return ids.new_empty((R, max_k + 1), **I32), ids.new_empty((R,), **I32)


def _tree(ids, cu, parents, target, q, seeds, offsets, max_k):
    R = cu.shape[0] - 1
    return (target.new_empty((R, max_k + 1), **I32), target.new_empty((R, max_k), **I32),
            target.new_empty((R,), **I32))


FAKES = {
    "sample": lambda logits, *_: (logits.new_empty((logits.shape[0],), **I32),
                                  logits.new_empty(logits.shape, dtype=torch.float32)),
    "ngram_propose": lambda ids, n, lo, hi, k: (ids.new_empty((ids.shape[0], k), **I32),
                                                ids.new_empty((ids.shape[0],), **I32)),
    "verify_greedy": lambda ids, cu, logits, max_k: _verify(ids, cu, max_k),
    "verify_rejection": lambda ids, cu, q, p, s, o, max_k: _verify(ids, cu, max_k),
    "verify_rejection_logits": lambda ids, cu, q, logits, t, s, o, max_k: _verify(ids, cu, max_k),
    "verify_typical": lambda ids, cu, p, s, o, max_k, eps, delta: _verify(ids, cu, max_k),
    "verify_tree": _tree,
    "process_logits": lambda logits, *_: logits.new_empty(logits.shape, dtype=torch.float32),
    "write_kv": lambda *_: None,
    "paged_attention": lambda query, *_: torch.empty_like(query),
    "copy_kv": lambda *_: None,
}


def register_module(namespace: str, names: dict) -> None:
    """Replace every op function in a backend's op module namespace (pass ``globals()``) by
    its custom op ``namespace::op``."""
    names.update(vars(register(namespace, {op: names[op] for op in FAKES})))


def register(namespace: str, impls: dict) -> SimpleNamespace:
    """Register each ``impls[op]`` (a function with the `hal.ops.Ops` signature and type
    annotations) as ``namespace::op``; returns the custom ops, by op name."""
    ops = {}
    for name, fn in impls.items():
        op = torch.library.custom_op(f"{namespace}::{name}", fn, mutates_args=MUTATES.get(name, ()))
        op.register_fake(FAKES[name])
        ops[name] = op
    return SimpleNamespace(**ops)
