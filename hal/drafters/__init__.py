"""Drafters: what proposes the tokens the target verifies. Each reads a
`hal.engine.drafting.DraftBatch` and returns a `hal.engine.drafting.Proposal`; the one
table of ``--draft`` kinds is `hal.drafters.kinds`."""

from hal.drafters.eagle import EagleDrafter, NgramOrHead
from hal.drafters.model import ModelDrafter
from hal.drafters.ngram import NgramDrafter, NgramTreeDrafter

__all__ = ["EagleDrafter", "ModelDrafter", "NgramDrafter", "NgramOrHead", "NgramTreeDrafter"]
