"""Drafting with a DFlash block drafter (z-lab's ``DFlashDraftModel``, or DeepSpec's DFlash
checkpoints): one forward of ``[anchor, mask x (B - 1)]`` over the target's fused features
proposes the whole block, with no Markov link between its positions and no confidence head, so
every proposal is offered to the router. The forward, the context cache and the layouts are the
block drafter's (`hal.models.dspark.DSparkModel`, `hal.models.block_layouts`); DSpark adds its
two heads (`hal.drafters.dspark.DSparkDrafter`)."""

from __future__ import annotations

from hal.drafters.dspark import DSparkDrafter
from hal.errors import HalError
from hal.models.dspark import Confidence, DSparkModel


class DFlashDrafter(DSparkDrafter):
    """A `hal.engine.drafting.Drafter` for a block drafter without Markov or confidence heads."""

    kind = "dflash"

    def __init__(self, model: DSparkModel, num_blocks: int = 512, block_size: int = 16):
        if model.cfg.rank or model.cfg.confidence != Confidence.NONE:
            raise HalError(f"DFlash drafter: expected a block drafter without Markov or confidence heads, got "
                           f"markov rank {model.cfg.rank}, confidence {model.cfg.confidence.name}")
        super().__init__(model, num_blocks, block_size)
