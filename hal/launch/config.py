"""What a model and its engine are launched with, validated once into a frozen config (vLLM's
``VllmConfig``, nano-vllm's ``Config``): every entry point (``spec-hal serve``, the launcher
``python -m hal.launch``, their torchrun ranks) parses its flags, builds a `LaunchConfig` with
`LaunchConfig.from_args`, and `hal.launch.start.start` and what it calls read only the config.
A field an entry point has no flag for is given by that entry point, by name; nothing falls back
to a default found by ``getattr`` on a namespace."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from hal.errors import HalError

ROW_CODES = ("auto", "1", "2")   # --row-codes (`hal.models.loaders.file_row_codes`)
SERVE_BUDGET = "auto"   # max_num_batched_tokens: `hal.launch.build.serving_budget` chooses (serve's flag unset)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: the model and its plan, the draft, the engine and the draft link's settings."""

    # the model and its linear plan (`hal.launch.flags.add_dtype_args`)
    model: str
    dtype: str
    lm_head: str
    row_codes: str                    # auto, 1 or 2: int8 codes per input of a q4q8 plan's rows (--row-codes)
    plan_refresh: bool
    # the draft and the router
    draft: str
    k: int
    route: bool
    # the engine
    max_context: int                  # prompt + generated tokens per request (serve: --max-model-len)
    max_num_seqs: int                 # requests running at once (the memory plan's sequences)
    max_num_batched_tokens: int | str | None   # per step; None: unbounded; SERVE_BUDGET: chosen per device
    batch_invariant: bool
    enable_prefix_caching: bool | None
    memory_fraction: float
    cpu_budget_gib: float
    # a draft on another rank or thread
    draft_startup_timeout: float
    draft_timeout: float
    fanout: int | None
    push: bool
    draft_thread: str
    placement_acceptance: float
    placement_hit_rate: float

    def __post_init__(self):
        if isinstance(self.max_context, bool) or not isinstance(self.max_context, int) or self.max_context < 2:
            raise HalError(f"max_context: expected an int >= 2, got {self.max_context!r}", arg="max_context")
        if isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise HalError(f"max_num_seqs: expected an int >= 1, got {self.max_num_seqs!r}", arg="max_num_seqs")
        b = self.max_num_batched_tokens
        if not (b is None or b == SERVE_BUDGET or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)):
            raise HalError(f"max_num_batched_tokens: expected None, {SERVE_BUDGET!r} or an int >= 1, got {b!r}",
                           arg="max_num_batched_tokens")
        if self.row_codes not in ROW_CODES:
            raise HalError(f"row_codes: expected one of {ROW_CODES}, got {self.row_codes!r}", arg="row_codes")
        if self.draft_thread not in ("auto", "on", "off"):
            raise HalError(f"draft_thread: expected auto, on or off, got {self.draft_thread!r}", arg="draft_thread")

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, max_context: int, max_num_seqs: int,
                  max_num_batched_tokens: int | str | None) -> "LaunchConfig":
        """The config of a parser built with `hal.launch.flags.add_engine_args`; the three
        fields whose flags differ between entry points are given here. A flag the parser lacks
        is an error, not a default."""
        given = {"max_context": max_context, "max_num_seqs": max_num_seqs,
                 "max_num_batched_tokens": max_num_batched_tokens}
        values = {}
        for f in fields(cls):
            if f.name in given:
                values[f.name] = given[f.name]
            elif hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
            else:
                raise HalError(f"{f.name}: expected the entry point's flags to set it (add_engine_args), got none",
                               arg=f.name)
        return cls(**values)
