"""Drafters: what proposes the tokens the target verifies. Each reads a
`hal.engine.drafting.DraftBatch` and returns a `hal.engine.drafting.Proposal`; the one
table of ``--draft`` kinds is `hal.drafters.registry`."""

from hal.drafters.eagle import HeadDrafter, NgramOrHead
from hal.drafters.model import EagleDrafter, ModelDrafter
from hal.drafters.ngram import NgramDrafter, NgramTreeDrafter

__all__ = ["EagleDrafter", "HeadDrafter", "ModelDrafter", "NgramDrafter", "NgramOrHead", "NgramTreeDrafter"]
