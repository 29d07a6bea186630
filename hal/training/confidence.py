"""Refitting a DSpark drafter's confidence head on held-back sequences (issue 35 item 3).

The confidence head trains with the drafter (`hal.training.dspark_train.losses`), on the
sequences the drafter fits. There the drafter is right more often than on text it has not
seen, so the head can learn to be sure of itself, and a routed cut that trusts it verifies what
does not pay. This module fits the head again, the drafter frozen, on sequences the drafter
never took a gradient from (its validation split): an L2-regularised logistic regression on the
head's own inputs, the inputs and strength chosen by cross-validation between two halves of
those sequences. (On the retired dspark-block drafter, whose head also read the row's log max
softmax, that input alone won: *Benchmarks*, DSpark.)

Glossary:
- inputs of a proposed position j: ``[h_j, markov_w1[x_{j-1}]]`` or ``h_j``
  (`DSparkTrain.confidence_inputs`), x_{j-1} the token before it (teacher-forced: the target's
  own token, which is the drafted one whenever position j is reached);
- label: whether row j's argmax is the target's token there (a token outside the draft
  vocabulary is a miss);
- dense anchors: every response position anchors a block, so each held-back sequence gives
  about (B - 1) x its response length samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError

L2 = (1e-4, 1e-3, 1e-2, 1e-1)   # strengths tried (on the mean BCE; the bias is not penalised)


def samples(model, d, idx: list[int], to_draft: Tensor) -> tuple[Tensor, Tensor]:
    """The confidence head's inputs [n, width] and labels [n] (float 0/1) at every valid proposed
    position of blocks anchored at every response position of sequences ``idx`` of ``d``
    (a `hal.training.block_data.BlockData`), in float64."""
    from hal.training.block_data import block_targets
    xs, ys = [], []
    with torch.no_grad():
        for i in idx:
            feats, ids, starts, lens, _ = d.batch([i])
            anchors = torch.arange(int(starts[0]), int(lens[0]) - 1)[None]
            if anchors.numel() == 0:
                continue
            base, h = model(feats, ids, anchors)
            prev, label, valid = block_targets(ids, anchors, lens, model.cfg.proposals, to_draft)
            rows = base + model.markov(prev)
            right = (rows.argmax(-1) == label) & (label >= 0)
            xs.append(model.confidence_inputs(h, prev)[valid].double())
            ys.append(right[valid].double())
    width = model.w("conf").shape[0]
    return (torch.cat(xs) if xs else torch.zeros(0, width, dtype=torch.float64),
            torch.cat(ys) if ys else torch.zeros(0, dtype=torch.float64))


def bce(x: Tensor, y: Tensor, w: Tensor) -> float:
    """Mean BCE of the head ``w`` ([width + 1]: the weights, then the bias) on inputs ``x``, labels ``y``."""
    return float(F.binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y))


def fit(x: Tensor, y: Tensor, l2: float, init: Tensor | None = None, steps: int = 200) -> Tensor:
    """The head [width + 1] minimising mean BCE + ``l2`` * |weights|^2 on (``x``, ``y``) (L-BFGS, float64;
    the objective is convex, so ``init`` changes the time, not the answer)."""
    w = (init.clone().double() if init is not None else torch.zeros(x.shape[1] + 1, dtype=torch.float64))
    w.requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=steps, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return w.detach()


def _cv(xa: Tensor, ya: Tensor, xb: Tensor, yb: Tensor, cols: list[int], l2: float, init: Tensor) -> float:
    """Out-of-fold BCE of heads on columns ``cols``: each half fitted on the other."""
    i = init[cols + [-1]]
    out = [bce(xb[:, cols], yb, fit(xa[:, cols], ya, l2, i)) * len(yb),
           bce(xa[:, cols], ya, fit(xb[:, cols], yb, l2, i)) * len(ya)]
    return sum(out) / max(1, len(ya) + len(yb))


def refit(model, d, to_draft: Tensor, grid: tuple[float, ...] = L2) -> tuple[Tensor, Tensor, dict]:
    """(conf [width], conf_bias [1], report) of the confidence head refitted on ``d.val`` only.

    The input sets tried: the hidden state alone, and with `Confidence.MARKOV` the Markov row
    alone and both (weights outside a set left at zero), each at every strength of ``grid``; the pair with the least
    BCE out of fold (two halves of the held-back sequences, each fitted on the other) is then
    fitted on both halves. The report gives that BCE beside the joint head's and a constant's on
    the same sequences (the joint head never saw them either)."""
    H = model.cfg.hidden
    half = len(d.val) // 2
    xa, ya = samples(model, d, d.val[:half], to_draft)
    xb, yb = samples(model, d, d.val[half:], to_draft)
    if not len(ya) or not len(yb):
        raise HalError(f"confidence refit: expected held-back sequences with proposed positions in both halves, got "
                       f"{len(d.val)} sequence(s), {len(ya)} + {len(yb)} positions")
    x, y = torch.cat([xa, xb]), torch.cat([ya, yb])
    joint = torch.cat([model.w("conf").detach(), model.w("conf_bias").detach()]).double()
    width = x.shape[1]
    sets = {"hidden": list(range(H))} | ({"markov row": list(range(H, width)), "hidden and markov row":
                                          list(range(width))} if width > H else {})
    scores = {(name, l2): _cv(xa, ya, xb, yb, cols, l2, joint) for name, cols in sets.items() for l2 in grid}
    name, l2 = min(scores, key=scores.get)
    cols = sets[name]
    w = torch.zeros(width + 1, dtype=torch.float64)
    w[cols + [-1]] = fit(x[:, cols], y, l2, joint[cols + [-1]])
    rate = float(y.mean().clamp(1e-6, 1 - 1e-6))
    report = {"sequences": len(d.val), "positions": len(y), "accept_rate": rate, "inputs": name, "l2": l2,
              "bce_out_of_fold": scores[(name, l2)], "bce_joint_head": bce(x, y, joint),
              "bce_constant": float(F.binary_cross_entropy(torch.full_like(y, rate), y)),
              "bce_by_choice": {f"{n}, l2 {v:g}": s for (n, v), s in scores.items()}}
    return w[:-1].float(), w[-1:].float(), report


def readme_line(report: dict, refitted: str | None = None) -> str:
    """The drafter README's paragraph on its confidence head (``refitted``: the folder it came from)."""
    how = (f"`python -m hal train-head --kind dspark --refit-confidence {refitted}`" if refitted
           else "the end of training")
    return (f"- Confidence head: refitted by {how} on the {report['sequences']} held-back sequences "
            f"({report['positions']:,} proposed positions, {report['accept_rate']:.0%} right"
            + (f"; data made {report['data_made']}" if report.get("data_made") else "") + "), inputs "
            f"{report['inputs']}, L2 {report['l2']:g}: BCE out of fold **{report['bce_out_of_fold']:.3f}**, against "
            f"{report['bce_joint_head']:.3f} for the head trained with the drafter and "
            f"{report['bce_constant']:.3f} for a constant (`hal/training/confidence.py`).\n")
