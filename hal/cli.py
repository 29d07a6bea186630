"""``python -m hal`` / ``spec-hal``: info, conformance, demo."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_info(_args) -> int:
    from hal import list_backends
    rows = [("backend", "available", "device", "block sizes", "head_dim %", "validation")]
    for b in list_backends():
        avail = "yes" if b.available else f"no: {b.reason}"
        rows.append((b.name, avail, b.device_type, b.block_sizes, str(b.head_dim_align), b.validation))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sel = os.environ.get("HAL_BACKEND", "auto")
    print(f"\nHAL_BACKEND={sel}")
    return 0


def cmd_conformance(args, extra: list[str]) -> int:
    import pytest
    if args.plugin:
        os.environ["HAL_PLUGINS"] = ",".join(filter(None, [os.environ.get("HAL_PLUGINS", ""), *args.plugin]))
    import hal
    try:
        hal.get_backend(args.backend)  # fail fast, with the registry's explanation
    except hal.HalError as e:
        print(f"conformance: {e}", file=sys.stderr)
        return 2
    from importlib.metadata import entry_points
    installed = any(ep.value == "hal.conformance.plugin" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "hal.conformance.plugin"]  # running from a source tree
    return int(pytest.main(["--pyargs", "hal.conformance", "--hal-backend", args.backend, *plugin,
                            "-p", "no:cacheprovider", "-q",
                            "-W", "ignore::pytest.PytestAssertRewriteWarning", *extra]))


def cmd_demo(_args) -> int:
    """One readable verify round on the selected backend."""
    import torch

    import hal
    be = hal.get_backend()
    vocab = ["<s>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    # Two requests. The target agrees with "the cat" but wants "on" where the draft says
    # "sat"; it agrees with all of "a dog" and adds a bonus token.
    target_tokens = [[1, 2, 4, 4, 5], [6, 7, 3]]    # target argmax per row (k + 1 rows each)
    drafts = [[1, 2, 3, 4], [6, 7]]
    ids = torch.tensor([t for d in drafts for t in d])
    cu = torch.tensor([0, 4, 6])
    logits = torch.full((sum(map(len, target_tokens)), len(vocab)), -5.0)
    logits[torch.arange(logits.shape[0]), torch.tensor([t for r in target_tokens for t in r])] = 5.0
    dev = be.device_type
    out, n = be.verify_greedy(ids.to(dev), cu.to(dev), logits.to(dev), 4)
    print(f"backend: {be.name}")
    for r, d in enumerate(drafts):
        row = [vocab[t] for t in out[r].tolist() if t >= 0]
        print(f"request {r}: drafts {[vocab[t] for t in d]!s:<34} target argmax {[vocab[t] for t in target_tokens[r]]}")
        print(f"           accepted {int(n[r])}/{len(d)} -> emits {row}")
    seeds, offsets = torch.tensor([1, 2]), torch.tensor([0, 0])
    probs = torch.softmax(logits / 2.0, -1)
    out, n = be.verify_rejection(ids.to(dev), cu.to(dev), None, probs.to(dev), seeds.to(dev), offsets.to(dev), 4)
    print("rejection sampling (T=2, n-gram style drafts):",
          [[vocab[t] for t in row if t >= 0] for row in out.tolist()], "accepted", n.tolist())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="spec-hal", description="spec-hal: speculative decoding HAL")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="backends, availability, block sizes, validation level")
    c = sub.add_parser("conformance", help="run the conformance suite against a backend "
                                           "(extra arguments go to pytest)")
    c.add_argument("--backend", required=True)
    c.add_argument("--plugin", action="append", default=[], help="extra plugin module (repeatable)")
    sub.add_parser("demo", help="one readable verify round on the selected backend")
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "conformance":
        return cmd_conformance(args, extra)
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    return {"info": cmd_info, "demo": cmd_demo}[args.cmd](args)
