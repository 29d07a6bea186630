"""The engine: continuous batching of requests through draft -> verify -> accept, one
ragged target forward per step (`SpeculativeDecoder`), with its request types, router and
memory plan. Knows drafters only through the `Drafter` protocol."""

from hal.engine.decoder import SpeculativeDecoder
from hal.engine.drafting import DraftBatch, Drafter, Proposal
from hal.engine.requests import Request, SamplingParams, StepOutput

__all__ = ["DraftBatch", "Drafter", "Proposal", "Request", "SamplingParams", "SpeculativeDecoder", "StepOutput"]
