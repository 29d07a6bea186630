"""What ``HAL_PLACEMENT=auto`` measures at start-up (`hal.launch.start`), for `hal.distributed.auto.choose`.

- **Devices**: every device of an available registered backend (one backend per device: the
  highest priority), with its free memory (the backend's ``memory`` hook; on cpu the
  ``--cpu-budget-gib`` budget).
- **Costs per device**: the target's forward over T fed tokens and the drafter's chain of k
  (`hal.engine.costs.profile_costs`, `profile_drafter`), each model loaded there and
  timed, then dropped.
- **The other rank** (two ranks): the draft worker measures its own devices' drafting costs
  and the link as it sees it (round trip and bandwidth to the target's store), and publishes
  them in the rendezvous store (``hal/profile``). The target reads them as untrusted input
  (`parse_profile`), chooses, and publishes its choice (``hal/choice``): the other rank's
  device, or none (the worker then exits: the draft runs in the target's process, or nowhere)."""

from __future__ import annotations

import json
import math
import re
import sys
import time

import torch

from hal.distributed.auto import DeviceProfile, LinkProfile
from hal.distributed.placement import Side
from hal.engine.memory import GiB
from hal.launch.config import LaunchConfig
from hal.errors import HalError

PROFILE, CHOICE = "hal/profile", "hal/choice"
MAX_DEVICES, MAX_POINTS = 64, 64
NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}(:[0-9]{1,4})?$")


def local_sides() -> list[Side]:
    """Every device of an available backend here, the highest-priority backend per device
    (planted backends of negative priority are never chosen)."""
    from hal import registry
    specs = registry.specs()
    out, seen = [], set()
    for row in sorted(registry.list_backends(), key=lambda r: -specs[r.name].priority):
        spec = specs[row.name]
        if not row.available or spec.priority < 0:
            continue
        mod = getattr(torch, spec.device_type, None) if spec.device_type != "cpu" else None
        count = int(mod.device_count()) if mod is not None and hasattr(mod, "device_count") else 1
        for i in range(max(1, count)):
            dev = torch.device(spec.device_type) if spec.device_type == "cpu" else torch.device(spec.device_type, i)
            if str(dev) not in seen:
                seen.add(str(dev))
                out.append(Side(registry.get_backend(row.name), dev, row.name if dev.index is None else f"{row.name}:{i}"))
    return out


def free_bytes(side: Side, cpu_budget_gib: float) -> int:
    mem = side.backend.spec.memory
    return int(cpu_budget_gib * GiB) if mem is None else int(mem(side.device.index or 0)[0])


def profile_sides(sides: list[Side], path: str, spec, config: LaunchConfig, reps: int = 3, with_target: bool = True,
                  hidden: int | None = None) -> list[DeviceProfile]:
    """Each side's measured `DeviceProfile` (``with_target`` False: the drafter only, a
    worker's; ``hidden``: the target's width then)."""
    from hal.drafters.kinds import HEADS, draft_memory, make_drafter
    from hal.models.fetch import load_model
    from hal.engine.memory import target_pool
    from hal.engine.costs import CostModel, profile_costs, profile_drafter
    out = []
    for s in sides:
        t0 = time.perf_counter()
        model = None
        if with_target or spec.kind in HEADS:
            model = load_model(path, s.backend, config.dtype, lm_head=config.lm_head,
                               row_codes=config.row_codes)[0].to(s.device)
        _, dpath = draft_memory(spec, path, shares_target=with_target)
        drafter = make_drafter(spec, s.backend, target=model, path=config.model if spec.kind in HEADS else dpath,
                               device=s.device)
        if with_target:
            cost = profile_costs(model, drafter, target_pool(model, 96), max_tokens=min(72, max(9, (config.k + 1) * 4)),
                                 context=256, reps=reps)
            target, draft = CostModel(cost.verify, {}, cost.per_context), cost.draft or None
        else:
            target = None
            draft = None if drafter is None else profile_drafter(drafter, s.device, hidden or model.cfg.hidden, reps)
        out.append(DeviceProfile(s.spec, free_bytes(s, config.cpu_budget_gib), target, draft))
        print(f"placement auto: measured {s.device} ({s.backend.name}) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        del model, drafter
    return out


def measure_link(store, n: int = 15, payload: int = 1 << 20) -> tuple[float, float]:
    """(round trip s, bandwidth bytes/s) to ``store``'s host: the median of ``n`` key checks,
    and one ``payload``-byte write less a round trip."""
    rtts = []
    for _ in range(n):
        t = time.perf_counter()
        store.check([PROFILE + "/ping"])
        rtts.append(time.perf_counter() - t)
    rtt = sorted(rtts)[n // 2]
    t = time.perf_counter()
    store.set(PROFILE + "/payload", b"\0" * payload)
    return rtt, payload / max(time.perf_counter() - t - rtt, 1e-6)


def publish_profile(store, devices: list[DeviceProfile], rtt: float, bandwidth: float) -> None:
    store.set(PROFILE, json.dumps({"rtt_s": rtt, "bandwidth": bandwidth, "devices": [
        {"name": d.name, "free_bytes": d.free_bytes, "draft": {str(k): v for k, v in (d.draft or {}).items()}}
        for d in devices]}))


def parse_profile(text) -> LinkProfile:
    """The worker's published profile (untrusted): `HalError` naming what is out of shape."""
    def bad(what: str, got) -> HalError:
        return HalError(f"{PROFILE}: expected {what}, got {str(got)[:120]}", arg=PROFILE, expected=what, got=str(got))

    def seconds(v, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 3600:
            raise bad(f"{what}: seconds in [0, 3600)", v)
        return float(v)
    try:
        got = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("JSON", e) from None
    if not isinstance(got, dict) or set(got) != {"rtt_s", "bandwidth", "devices"}:
        raise bad("an object with rtt_s, bandwidth and devices", got)
    bw = got["bandwidth"]
    if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
        raise bad("bandwidth: bytes/s > 0", bw)
    devs = got["devices"]
    if not isinstance(devs, list) or not 1 <= len(devs) <= MAX_DEVICES:
        raise bad(f"devices: a list of 1 to {MAX_DEVICES}", devs)
    out = []
    for d in devs:
        if not isinstance(d, dict) or set(d) != {"name", "free_bytes", "draft"}:
            raise bad("a device {name, free_bytes, draft}", d)
        name, free, table = d["name"], d["free_bytes"], d["draft"]
        if not isinstance(name, str) or not NAME.match(name):
            raise bad("a device name such as cpu or cuda:1", name)
        if isinstance(free, bool) or not isinstance(free, int) or not 0 <= free < 1 << 50:
            raise bad("free_bytes: an integer in [0, 2**50)", free)
        if not isinstance(table, dict) or len(table) > MAX_POINTS or not all(
                isinstance(k, str) and k.isdigit() and 1 <= int(k) <= 1024 for k in table):
            raise bad(f"draft: at most {MAX_POINTS} points k (1..1024) -> seconds", table)
        draft = {int(k): seconds(v, f"draft[{k}]") for k, v in table.items()}
        out.append(DeviceProfile(name, free, None, draft or None))
    return LinkProfile(seconds(got["rtt_s"], "rtt_s"), float(bw), tuple(out))


def publish_choice(store, draft: str | None) -> None:
    """``draft``: the other rank's device the draft goes to, or None (not on that rank)."""
    store.set(CHOICE, json.dumps({"draft": draft}))


def read_choice(store, names: list[str]) -> str | None:
    """The target's choice (untrusted): one of ``names`` (this rank's devices) or None."""
    try:
        got = json.loads(store.get(CHOICE))
    except (ValueError, UnicodeDecodeError) as e:
        raise HalError(f"{CHOICE}: expected JSON, got {e}") from None
    if not isinstance(got, dict) or set(got) != {"draft"} or not (got["draft"] is None or got["draft"] in names):
        raise HalError(f"{CHOICE}: expected {{\"draft\": one of {names} or null}}, got {str(got)[:120]}")
    return got["draft"]


def auto_target(config: LaunchConfig, spec, path: str, max_seqs: int, rv=None):
    """The target rank's automatic placement: ``(Placement, AutoChoice)`` from this rank's
    measured devices and, with ``rv`` (two ranks), the worker's published profile and link;
    the choice is published for the worker. Printed with its runner-up."""
    from hal.distributed.placement import Placement
    from hal.drafters.kinds import draft_memory
    from hal.engine.memory import ModelMemory
    from hal.models.loaders import read_config
    devices = profile_sides(local_sides(), path, spec, config)
    link = None
    if rv is not None:   # the worker measured its side while this rank measured its own
        rv.store.set_timeout(_td(max(600.0, config.draft_startup_timeout)))
        link = parse_profile(rv.store.get(PROFILE))
    ctx, batch = config.max_context, max(1, max_seqs)

    def need(mem) -> int:
        return 0 if mem is None else mem.weight_bytes + mem.kv_bytes_per_token() * batch * ctx
    placement, choice = Placement.auto(
        devices, target_bytes=need(ModelMemory.from_config(read_config(path), "target")),
        draft_bytes=need(draft_memory(spec, path, shares_target=False)[0]), batch=batch,
        acceptance=config.placement_acceptance, max_k=config.k, context=min(ctx, 512), link=link,
        hit_rate=ahead_hit_rate(config, spec))
    if rv is not None:
        publish_choice(rv.store, choice.best.draft if choice.best.where == "other rank" else None)
    return placement, choice


def worker_fanout(config: LaunchConfig, spec) -> int:
    """Branches the draft worker drafts ahead per request and round: ``--fanout`` where given,
    else `hal.distributed.worker.FANOUT`, except for a head (the chain head drafts ahead from
    its own features only when ``--fanout`` asks: measured, it does not pay yet; see
    docs/benchmarks.md); 0 for a kind that cannot (`DraftKind.ahead`)."""
    from hal.distributed.worker import FANOUT
    from hal.drafters.kinds import KINDS
    kind = KINDS[spec.kind]
    if not kind.ahead:
        return 0
    return config.fanout if config.fanout is not None else 0 if kind.head else FANOUT


def ahead_hit_rate(config: LaunchConfig, spec) -> float:
    """The speculation-cache hit rate another rank is scored at: ``--placement-hit-rate``, or
    0 where the worker does not draft ahead (`worker_fanout` 0)."""
    return config.placement_hit_rate if worker_fanout(config, spec) else 0.0


def auto_worker(config: LaunchConfig, spec, path: str, rv) -> str | None:
    """The draft rank's part: measure its devices and the link, publish them, and return the
    device the target chose for the draft here (None: not on this rank)."""
    from hal.drafters.kinds import HEADS
    from hal.models.loaders import read_config
    hidden = read_config(path).hidden if spec.kind in HEADS else 1   # only a head reads the target's features
    devices = profile_sides(local_sides(), path, spec, config, with_target=False, hidden=hidden)
    publish_profile(rv.store, devices, *measure_link(rv.store))
    rv.store.set_timeout(_td(max(600.0, config.draft_startup_timeout)))   # the target measures its own devices too
    return read_choice(rv.store, [d.name for d in devices])


def _td(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)
