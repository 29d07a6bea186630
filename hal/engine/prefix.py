"""Automatic prefix caching at admission (vLLM's): which leading blocks of a request's
tokens are already in the target's KV pool (`hal.kv.BlockAllocator.match`), and whether
another request's prefill is computing them right now (then this one waits a step and
reuses them rather than computing them twice: ``n > 1`` samples, a shared system prompt).

A request always computes at least its last prefill token (its logits give the first
token, or a resumed request's last hidden state), so at most ``(prefill_end - 1) // block_size``
blocks come from the cache."""

from __future__ import annotations

from hal import kv
from hal.engine.requests import State


def pending(prefilling: list[State]) -> set[bytes]:
    """Names that requests in prefill will cache but have not yet."""
    out: set[bytes] = set()
    for state in prefilling:
        if state.names:
            out.update(state.names[len(state.seq.hashes):])
    return out


def lookup(state: State, allocator: kv.BlockAllocator, in_flight: set[bytes]) -> tuple[list[int], bool]:
    """The cached blocks ``state`` would start on, and whether it should wait because a
    request in prefill is computing its next block."""
    wanted = state.block_names(allocator.block_size)
    hit = allocator.match(wanted)
    return hit, len(hit) < len(wanted) and wanted[len(hit)] in in_flight
