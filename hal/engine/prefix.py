"""Automatic prefix caching at admission (vLLM's): which leading blocks of a request's
tokens are already in the target's KV pool (`hal.kv.BlockAllocator.match`), and whether
another request's prefill is computing them right now (then this one waits a step and
reuses them rather than computing them twice: ``n > 1`` samples, a shared system prompt).

A request always computes at least its last prefill token (its logits give the first
token, or a resumed request's last hidden state), so at most ``(prefill_end - 1) // block_size``
blocks come from the cache. With a drafter that reads the target's features, only blocks whose
feature rows are cached too (`hal.engine.feature_cache`) are taken."""

from __future__ import annotations

from typing import Callable

from hal import kv
from hal.engine.requests import State
from hal.errors import HalError

Usable = Callable[[list[bytes]], int]   # how many leading block names may be taken (the feature cache's)


def enabled(enable: bool | None) -> bool:
    """Whether the target pool caches prefixes: on unless ``enable`` is False (a drafter that
    reads the target's features gets the cached blocks' rows from `hal.engine.feature_cache`)."""
    if enable is not None and not isinstance(enable, bool):
        raise HalError(f"enable_prefix_caching: expected None, True or False, got {enable!r}")
    return enable is not False


def pending(prefilling: list[State]) -> set[bytes]:
    """Names that requests in prefill will cache but have not yet."""
    out: set[bytes] = set()
    for state in prefilling:
        if state.names:
            out.update(state.names[len(state.seq.hashes):])
    return out


def lookup(state: State, allocator: kv.BlockAllocator, in_flight: set[bytes],
           usable: Usable | None = None) -> tuple[list[int], bool]:
    """The cached blocks ``state`` would start on (no more than ``usable`` allows), and whether it
    should wait because a request in prefill is computing its next block."""
    wanted = state.block_names(allocator.block_size)
    hit = allocator.match(wanted)
    if usable is not None:
        hit = hit[:usable(wanted)]
    return hit, len(hit) < len(wanted) and wanted[len(hit)] in in_flight
