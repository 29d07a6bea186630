"""What a plugin registers (`BackendSpec`) and what users get (`Backend`).

`Backend` wraps a backend's op module: each method validates its arguments
(`hal.checks`) and then calls the backend's plain function directly. No pluggy
call and no lookup by op name happens per op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from hal import checks, processor_checks
from hal.errors import HalError, arg_error
from hal.reductions import first_max
from hal.ops import Ops


@dataclass(frozen=True)
class BlockSizes:
    """The KV block sizes a backend supports: ``lo <= bs <= hi``, a multiple of
    ``multiple_of`` and, if ``power_of_two``, a power of two."""

    lo: int = 1
    hi: int = 1 << 16
    multiple_of: int = 1
    power_of_two: bool = True

    def __contains__(self, bs: object) -> bool:
        return (isinstance(bs, int) and not isinstance(bs, bool) and self.lo <= bs <= self.hi
                and bs % self.multiple_of == 0 and (not self.power_of_two or bs & (bs - 1) == 0))

    def __str__(self) -> str:
        kind = "powers of two" if self.power_of_two else "sizes"
        mult = f", multiples of {self.multiple_of}" if self.multiple_of > 1 else ""
        return f"{kind} {self.lo}..{self.hi}{mult}"


@dataclass(frozen=True)
class BackendSpec:
    """A backend as a plugin registers it.

    :param name: the name users select with ``HAL_BACKEND``.
    :param device_type: the torch device type its tensors live on (``"cpu"``,
        ``"cuda"``, ``"npu"``).
    :param load: imports and returns the op module: an object with every
        `hal.ops.Ops` function. Called only when the backend is selected.
    :param probe: returns ``None`` when the backend can run here, else the
        reason it cannot. Must be cheap and must not initialise a device
        runtime unless that runtime is already imported.
    :param priority: auto-selection picks the available backend with the
        highest priority.
    :param block_sizes: the KV block sizes it supports.
    :param head_dim_align: head_dim must be a multiple of this.
    :param validation: how it was validated, in words (shown by ``hal info``).
    :param always_check_values: run value checks (NaN, ranges, sums) on every
        call, not only under ``HAL_CHECK=1``. True where they cost no device sync.
    :param fuzz_examples: the examples per property the conformance fuzz runs here by default
        (``--slow`` and ``HAL_FUZZ_EXAMPLES`` override it); an interpreted backend, whose every
        example costs ~20x a native one, names fewer. None: the fuzz's default.
    :param draw_share: the share of a sampling test's draws (`test_sample.py`'s 100,000 rows) a
        default conformance run takes here (``--slow``: all); an interpreted backend, whose cost
        grows with the programs it launches, takes fewer and so detects only larger deviations.
    :param devices: the device types a `hal.distributed.placement.Placement` may name to get this
        backend (``"npu"`` for ascend); ``device_type`` is always one of them.
    :param collective: the torch.distributed backend for links between two ranks that
        both use this backend (``"nccl"``, ``"hccl"``); any other pair uses ``"gloo"``.
    :param memory: ``(free, total)`` bytes of device ``index``, for the memory planner;
        ``None`` where the backend cannot tell (plans then need explicit bytes).
    :param synchronize: waits until the device has finished all queued work
        (``torch.cuda.synchronize``, ``torch.npu.synchronize``); every timing (the
        router's profiler, ``benchmarks/``) goes through it. A no-op where ops run
        synchronously on the host (cpu, the interpreter, the emulation).
    """

    name: str
    device_type: str
    load: Callable[[], Any]
    probe: Callable[[], str | None] = lambda: None
    priority: int = 0
    block_sizes: BlockSizes = field(default_factory=BlockSizes)
    head_dim_align: int = 1
    validation: str = "unknown"
    always_check_values: bool = False
    devices: tuple[str, ...] = ()
    fuzz_examples: int | None = None   # examples per fuzz property in a default conformance run (None: 50)
    draw_share: float = 1.0
    collective: str = "gloo"
    memory: Callable[[int], tuple[int, int]] | None = None
    synchronize: Callable[[], None] = lambda: None

    def __post_init__(self):
        """A plugin's spec is checked where it is made: each bad field named, with what was expected."""
        def refuse(what: str, expected: str, got) -> None:
            raise HalError(f"BackendSpec {self.name!r}: {what}: expected {expected}, got {got!r}", arg=what,
                           expected=expected, got=repr(got))
        if not isinstance(self.name, str) or not self.name:
            refuse("name", "a non-empty str", self.name)
        if not isinstance(self.device_type, str) or not self.device_type:
            refuse("device_type", "a non-empty str", self.device_type)
        if not (isinstance(self.head_dim_align, int) and self.head_dim_align >= 1):
            refuse("head_dim_align", "an int >= 1", self.head_dim_align)
        if self.fuzz_examples is not None and not (isinstance(self.fuzz_examples, int) and self.fuzz_examples >= 1):
            refuse("fuzz_examples", "None or an int >= 1", self.fuzz_examples)
        if not (isinstance(self.draw_share, (int, float)) and 0 < self.draw_share <= 1):
            refuse("draw_share", "a share in (0, 1]", self.draw_share)

    def serves(self) -> tuple[str, ...]:
        return (self.device_type, *self.devices)


def _env_check_values() -> bool:
    return os.environ.get("HAL_CHECK", "0") not in ("", "0")


class Backend:
    """One selected backend: its spec plus its validated ops.

    The methods have the signatures and semantics documented on `hal.ops.Ops`;
    each runs the argument checks and calls the backend's function.
    """

    def __init__(self, spec: BackendSpec, impl: Ops):
        self.spec, self.impl = spec, impl
        self.name, self.device_type = spec.name, spec.device_type
        self._check_values = spec.always_check_values or _env_check_values()

    @property
    def check_values(self) -> bool:
        """Whether value checks run: never while ``torch.compile`` traces (reading values
        would break the graph); shape, dtype and device checks always do."""
        return self._check_values and not torch.compiler.is_compiling()

    @check_values.setter
    def check_values(self, on: bool) -> None:
        self._check_values = on

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, device_type={self.device_type!r})"

    def synchronize(self) -> None:
        """Wait for the device's queued work (`BackendSpec.synchronize`)."""
        self.spec.synchronize()

    def sample(self, logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
               seeds: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Checked `Ops.sample`."""
        checks.sample(self, logits, temperature, top_k, top_p, seeds, offsets)
        return self.impl.sample(logits, temperature, top_k, top_p, seeds, offsets)

    def ngram_propose(self, token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int,
                      k: int) -> tuple[Tensor, Tensor]:
        """Checked `Ops.ngram_propose`."""
        checks.ngram_propose(self, token_ids, num_tokens, min_n, max_n, k)
        return self.impl.ngram_propose(token_ids, num_tokens, min_n, max_n, k)

    def verify_greedy(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                      target_logits: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
        """Checked `Ops.verify_greedy`."""
        checks.verify_greedy(self, draft_token_ids, cu_num_draft_tokens, target_logits, max_k)
        return self.impl.verify_greedy(draft_token_ids, cu_num_draft_tokens, target_logits, max_k)

    def greedy_rows(self, target_logits: Tensor) -> Tensor:
        """What `verify_greedy` emits where nothing was drafted (every ``k`` 0): each row's
        first maximal index (its argmax; ties to the lowest id), ``[R, 1]`` int32, with its value check where checks
        are on (NaN or +inf raise `HalError` as there), and none of its ragged bookkeeping:
        a plain decode step's verify, about 0.6 ms less on a CPU. Not an `Ops` op: torch's
        argmax on the backend's device is the whole of it."""
        if target_logits.dim() != 2 or not target_logits.is_floating_point():
            raise arg_error("target_logits", "float logits [R, V]", f"{target_logits.dtype} {list(target_logits.shape)}")
        top, at = first_max(target_logits.float())   # the first maximal index, NaN propagated
        if self.check_values:
            checks.logits_values("target_logits", target_logits, top)
        return at.int()[:, None]

    def verify_rejection(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                         draft_probs: Tensor | None, target_probs: Tensor, seeds: Tensor,
                         offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
        """Checked `Ops.verify_rejection`."""
        checks.verify_rejection(self, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                target_probs, seeds, offsets, max_k)
        return self.impl.verify_rejection(draft_token_ids, cu_num_draft_tokens, draft_probs,
                                          target_probs, seeds, offsets, max_k)

    def verify_rejection_logits(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                                draft_probs: Tensor | None, target_logits: Tensor, temperature: Tensor,
                                seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
        """Checked `Ops.verify_rejection_logits`."""
        checks.verify_rejection_logits(self, draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits,
                                       temperature, seeds, offsets, max_k)
        return self.impl.verify_rejection_logits(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits,
                                                 temperature, seeds, offsets, max_k)

    def verify_typical(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                       target_probs: Tensor, seeds: Tensor, offsets: Tensor, max_k: int,
                       posterior_threshold: float = 0.09,
                       posterior_alpha: float = 0.3) -> tuple[Tensor, Tensor]:
        """Checked `Ops.verify_typical`."""
        checks.verify_typical(self, draft_token_ids, cu_num_draft_tokens, target_probs, seeds,
                              offsets, max_k, posterior_threshold, posterior_alpha)
        return self.impl.verify_typical(draft_token_ids, cu_num_draft_tokens, target_probs, seeds,
                                        offsets, max_k, posterior_threshold, posterior_alpha)

    def verify_tree(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor,
                    target: Tensor, draft_probs: Tensor | None, seeds: Tensor | None,
                    offsets: Tensor | None, max_k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Checked `Ops.verify_tree`."""
        checks.verify_tree(self, draft_token_ids, cu_num_draft_tokens, parent_ids, target,
                           draft_probs, seeds, offsets, max_k)
        return self.impl.verify_tree(draft_token_ids, cu_num_draft_tokens, parent_ids, target,
                                     draft_probs, seeds, offsets, max_k)

    def process_logits(self, logits: Tensor, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                       parent_ids: Tensor | None, penalties: Tensor | None, token_counts: Tensor | None,
                       prompt_mask: Tensor | None, bias: Tensor | None, bad_words: Tensor | None,
                       bad_word_owner: Tensor | None, history: Tensor | None, stop_ids: Tensor | None,
                       min_tokens: Tensor | None, min_p: Tensor | None, max_k: int) -> Tensor:
        """Checked `Ops.process_logits`."""
        processor_checks.process_logits(self, logits, draft_token_ids, cu_num_draft_tokens, parent_ids, penalties, token_counts,
                              prompt_mask, bias, bad_words, bad_word_owner, history, stop_ids, min_tokens, min_p,
                              max_k)
        return self.impl.process_logits(logits, draft_token_ids, cu_num_draft_tokens, parent_ids, penalties,
                                        token_counts, prompt_mask, bias, bad_words, bad_word_owner, history,
                                        stop_ids, min_tokens, min_p, max_k)

    def write_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
        """Checked `Ops.write_kv`."""
        checks.write_kv(self, key, value, k_cache, v_cache, slot_mapping)
        self.impl.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, query: Tensor, k_cache: Tensor, v_cache: Tensor,
                        block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                        scale: float, tree_mask: Tensor | None = None) -> Tensor:
        """Checked `Ops.paged_attention`."""
        checks.paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, scale, tree_mask)
        return self.impl.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale, tree_mask)

    def copy_kv(self, k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
        """Checked `Ops.copy_kv`."""
        checks.copy_kv(self, k_cache, v_cache, src_slots, dst_slots)
        self.impl.copy_kv(k_cache, v_cache, src_slots, dst_slots)
