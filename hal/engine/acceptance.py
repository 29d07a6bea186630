"""Acceptance as the router keeps it (`Ewma`), and what it buys (`expected_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ewma:
    """Acceptance as decayed counts: accepted drafts over (accepted + first rejections)."""

    decay: float
    accepted: float = 0.0
    trials: float = 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (accepted < drafted)

    def score(self, p: float) -> None:
        """One first draft scored, not verified: accepted with probability ``p`` (its expectation)."""
        self.accepted = self.decay * self.accepted + p
        self.trials = self.decay * self.trials + 1.0

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.trials + weight)


def expected_tokens(alpha: float, k: int) -> float:
    """Leviathan's E(k): tokens per verify step at per-token acceptance ``alpha``."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
