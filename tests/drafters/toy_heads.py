"""Test-only drafters: a chain from any EAGLE-style head callable (`ToyEagleDrafter`), for toy
heads whose drafts a test chooses."""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from hal.drafters.batching import sample_chain
from hal.engine.drafting import DraftBatch, Proposal
from hal.errors import HalError

EagleHead = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""An EAGLE-style head: ``(hidden [M, H], token_ids [M]) -> (logits [M, V], next_hidden [M, H])``,
where ``hidden`` is the target's final hidden state at the position that produced ``token_ids``."""


class ToyEagleDrafter:
    """Drafts by chaining an EAGLE-style head from the target's last hidden state."""

    def __init__(self, head: EagleHead, backend):
        self.head, self.be = head, backend

    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.hidden is None:
            raise HalError("ToyEagleDrafter.propose: expected the target's hidden states (DraftBatch.hidden), got None")
        h = batch.hidden
        last = batch.history.gather(1, (batch.num_tokens - 1).clamp(min=0)[:, None])[:, 0]
        state = {"h": h}

        def step(x, j):
            logits, state["h"] = self.head(state["h"], last.to(h.device) if x is None else x)
            return logits
        return sample_chain(batch, self.be, h.device, step)

    def commit(self, rids, kept) -> None:
        pass

    def release(self, rid) -> None:
        pass
