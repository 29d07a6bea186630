"""Where the draft and the target run, and how draft outputs cross between them.

``Placement(draft="npu:0", target="cuda:0")`` or ``HAL_PLACEMENT="draft=ascend:0,target=cuda:0"``.
A side names a backend (``cuda``, ``ascend``, ``cpu``, a plugin) or a torch device
type that a registered backend serves (``npu`` -> ascend), with an optional index.
Each side gets its backend from the registry; nothing here branches on a device name.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from hal.errors import HalError, arg_error


@dataclass(frozen=True)
class Side:
    """One resolved side: its backend and the torch device its tensors live on."""

    backend: object
    device: torch.device
    spec: str


@dataclass(frozen=True)
class Placement:
    draft: str = "auto"
    target: str = "auto"
    measure: bool = False   # HAL_PLACEMENT=auto: measure at start-up and choose (`hal.launch.measure`)

    @classmethod
    def from_env(cls, value: str | None = None) -> "Placement":
        """Parse ``HAL_PLACEMENT`` (``draft=...,target=...``, either may be omitted; or
        ``auto``: measured at start-up, `hal.launch.measure`)."""
        value = os.environ.get("HAL_PLACEMENT", "") if value is None else value
        if value.strip() == "auto":
            return cls(measure=True)
        sides = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, eq, dev = part.partition("=")
            if not eq or key.strip() not in ("draft", "target") or not dev.strip():
                raise arg_error("HAL_PLACEMENT", "'draft=<backend or device>[:i],target=<backend or device>[:i]'",
                                repr(value))
            sides[key.strip()] = dev.strip()
        return cls(**sides)

    @classmethod
    def auto(cls, devices, **inputs):
        """``(Placement, AutoChoice)``: the placement `hal.distributed.auto.choose` predicts
        fastest for the measured ``devices`` (and ``link``, batch, acceptance, ...), printed
        with its runner-up on stderr. For plain decoding the draft side is the target's."""
        from hal.distributed.auto import choose
        choice = choose(devices, **inputs)
        print(choice.describe(), file=sys.stderr, flush=True)
        return cls(draft=choice.best.draft or choice.best.target, target=choice.best.target), choice

    def resolve(self) -> tuple[Side, Side]:
        """(draft side, target side)."""
        return resolve_side(self.draft, "draft"), resolve_side(self.target, "target")


def resolve_side(text: str, which: str = "device") -> Side:
    """A backend for ``text``: a backend name, else the highest-priority available backend
    that serves that device type. An explicit request never falls back silently."""
    from hal import registry
    name, _, index = text.partition(":")
    if index and not index.isdigit():
        raise arg_error(which, "'<backend or device type>[:<index>]'", repr(text))
    if name == "auto":
        be = registry.get_backend()
    elif name in registry.specs():
        be = registry.get_backend(name)
    else:
        serving = [r for r in registry.list_backends() if name in registry.specs()[r.name].serves()]
        usable = [r for r in serving if r.available]
        if not usable:
            why = "; ".join(f"{r.name}: {r.reason}" for r in serving) or "no registered backend serves it"
            raise HalError(f"{which}: expected an available backend or device type, got {text!r} ({why})")
        be = registry.get_backend(usable[0].name)
    dev = torch.device(be.device_type, int(index)) if index and be.device_type != "cpu" else torch.device(
        be.device_type)
    return Side(be, dev, text)


def link_backend(placement: Placement) -> str:
    """The torch.distributed backend between the draft and target ranks: the backends'
    own collective (nccl, hccl) when both sides name the same one, else gloo. Reads only
    the registered specs (a rank cannot probe the other rank's devices)."""
    from hal import registry

    def collective(text: str) -> str:
        name, specs = text.partition(":")[0], registry.specs()
        if name in specs:
            return specs[name].collective
        serving = sorted((s for s in specs.values() if name in s.serves()), key=lambda s: -s.priority)
        return serving[0].collective if serving else "gloo"
    a, b = collective(placement.draft), collective(placement.target)
    return a if a == b and "auto" not in (placement.draft, placement.target) else "gloo"
