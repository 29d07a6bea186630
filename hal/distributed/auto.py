"""Automatic placement: where the target and the draft go, chosen from measured inputs.

For each device: its free memory and its measured costs (`hal.engine.costs.CostModel`: the
target's forward over T fed tokens, the drafter's chain of k). For a second rank: the
measured link (round trip and bandwidth). The candidates are plain decoding, the draft on
the target's device, on another device in the same process (its work adds to the step), or
on another rank. There every round pays the link's round trip (the COMMIT that ends a
verification is answered only once it arrives, `hal.distributed.speculate`). A round whose
outcome the worker drafted ahead while the target verified (a speculation-cache hit, a share
``hit_rate`` of rounds) pays no drafting beyond that window; any other round pays the whole
chain after the round trip:

    step(k) = hit_rate * max(verify + link, draft) + (1 - hit_rate) * (verify + link + draft)

so at ``hit_rate`` 0 another rank is another device plus the link. Each candidate is scored
by expected tokens per second at the configured batch and acceptance (Leviathan's E(k), best
k up to ``max_k``); one that does not fit in memory is out. `choose` returns the best and the runner-up with
their predicted throughput; it raises `HalError` naming what is missing when nothing fits.

The inputs are data: `hal.launch.measure` measures them (`hal.engine.costs.profile_costs`, the memory plan, a
timed round trip), tests inject them."""

from __future__ import annotations

from dataclasses import dataclass, field

from hal.engine.costs import CostModel, interpolate
from hal.engine.acceptance import expected_tokens
from hal.errors import HalError


@dataclass(frozen=True)
class DeviceProfile:
    """One device as measured: ``free_bytes`` of memory, the target's and the drafter's
    costs on it (None: that model cannot run there)."""

    name: str
    free_bytes: int
    target: CostModel | None = None
    draft: dict[int, float] | None = None   # seconds per draft chain of k tokens


@dataclass(frozen=True)
class LinkProfile:
    """The link to the other rank: round trip (s) and bandwidth (bytes/s)."""

    rtt_s: float
    bandwidth: float
    rank_devices: tuple[DeviceProfile, ...] = ()   # the other rank's devices


@dataclass(frozen=True)
class Candidate:
    target: str
    draft: str | None          # None: plain decoding
    where: str                 # "plain", "same device", "other device", "other rank"
    k: int
    tokens_per_s: float

    def describe(self) -> str:
        on = "no draft" if self.draft is None else f"draft on {self.draft} ({self.where}), k {self.k}"
        return f"target on {self.target}, {on}: {self.tokens_per_s:.1f} tok/s predicted"


@dataclass(frozen=True)
class AutoChoice:
    best: Candidate
    runner_up: Candidate | None
    table: list[Candidate] = field(default_factory=list)
    hit_rate: float | None = None   # the speculation-cache hit rate another rank was scored at (None: no link)

    def describe(self) -> str:
        second = "none" if self.runner_up is None else self.runner_up.describe()
        assumed = "" if self.hit_rate is None else \
            f" (another rank scored at a {self.hit_rate:.0%} speculation-cache hit rate)"
        remote = next((c for c in self.table if c.where == "other rank"), None)
        shown = remote is None or remote in (self.best, self.runner_up)
        lower = "" if shown else f"; best on the other rank: {remote.describe()}"
        return f"placement auto: {self.best.describe()}; runner-up: {second}{lower}{assumed}"


def choose(devices: list[DeviceProfile], *, target_bytes: int, draft_bytes: int, batch: int, acceptance: float,
           max_k: int, context: int = 256, link: LinkProfile | None = None,
           draft_token_bytes: int = 8, hit_rate: float = 0.0) -> AutoChoice:
    """The placement with the most expected tokens/s (see the module docstring); its
    description names the best on another rank too when that ranks below the runner-up.
    ``target_bytes``/``draft_bytes``: each model's weights plus its KV pool at ``batch``;
    ``draft_token_bytes``: what one draft token costs on the link (ids; more with q);
    ``hit_rate``: the share of rounds a draft on another rank answers from its speculation
    cache (0 for a drafter that never drafts ahead)."""
    if batch < 1 or max_k < 0 or not 0 <= acceptance <= 1 or not 0 <= hit_rate <= 1:
        raise HalError(f"batch, max_k, acceptance, hit_rate: expected >= 1, >= 0, [0, 1] and [0, 1], got {batch}, "
                       f"{max_k}, {acceptance}, {hit_rate}")
    cands: list[Candidate] = []
    for t in devices:
        if t.target is None or t.free_bytes < target_bytes:
            continue
        verify = lambda k, t=t: t.target.cost(batch * (1 + k), batch * (1 + k) * context, 0)  # noqa: E731
        cands.append(Candidate(t.name, None, "plain", 0, batch / verify(0)))
        for d in devices:
            if not d.draft:
                continue
            same = d.name == t.name
            room = t.free_bytes - target_bytes if same else d.free_bytes
            if room < draft_bytes:
                continue
            cands.append(_best_k(t.name, d.name, "same device" if same else "other device", batch, acceptance,
                                 max_k, lambda k, d=d: verify(k) + _draft(d, k)))
        for d in (link.rank_devices if link is not None else ()):
            if not d.draft or d.free_bytes < draft_bytes:
                continue
            wire = lambda k, d=d: link.rtt_s + batch * k * draft_token_bytes / link.bandwidth  # noqa: E731
            cands.append(_best_k(t.name, d.name, "other rank", batch, acceptance, max_k,
                                 lambda k, d=d, w=wire: remote_step(verify(k), w(k), _draft(d, k), hit_rate)))
    if not cands:
        need = ", ".join(f"{d.name} ({d.free_bytes} bytes free{', no target costs' if d.target is None else ''})"
                         for d in devices) or "no devices"
        raise HalError(f"placement auto: expected a device with a measured target and {target_bytes} bytes free, "
                       f"got {need}")
    ranked = sorted(cands, key=lambda c: -c.tokens_per_s)
    return AutoChoice(ranked[0], ranked[1] if len(ranked) > 1 else None, ranked,
                      hit_rate if link is not None else None)


def remote_step(verify: float, link: float, draft: float, hit_rate: float) -> float:
    """Seconds per round with the draft on another rank (the module docstring's step(k))."""
    return hit_rate * max(verify + link, draft) + (1 - hit_rate) * (verify + link + draft)


def _draft(d: DeviceProfile, k: int) -> float:
    """The chain cost of k drafts on ``d`` (piecewise linear over the measured points)."""
    return interpolate(d.draft, k)


def _best_k(target: str, draft: str, where: str, batch: int, acceptance: float, max_k: int, step) -> Candidate:
    best = max(range(1, max(max_k, 1) + 1), key=lambda k: batch * expected_tokens(acceptance, k) / step(k))
    return Candidate(target, draft, where, best, batch * expected_tokens(acceptance, best) / step(best))
