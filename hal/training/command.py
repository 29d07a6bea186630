"""``spec-hal train-head``: its flags and the command (an EAGLE head, or a DSpark block drafter,
trained by self-distillation); `hal.cli` adds the subcommand."""

from __future__ import annotations

import argparse

from hal.launch.flags import bounded


def taps_flag(value: str) -> tuple[int, ...]:
    """``--taps``: comma-separated target layers, each one of the layers the block drafter's data records."""
    from hal.training.block_data import CANDIDATE_TAPS
    try:
        taps = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {value!r}") from None
    if not taps or list(taps) != sorted(set(taps)) or any(t not in CANDIDATE_TAPS for t in taps):
        raise argparse.ArgumentTypeError(f"expected increasing layers of {list(CANDIDATE_TAPS)}, got {value!r}")
    return taps


def cmd_train_head(args) -> int:
    from pathlib import Path

    if args.refit_confidence:   # no training: the confidence head of a trained drafter
        out = Path(args.out or f"{Path(args.refit_confidence).name}-refit")
        r = refit_folder(args.refit_confidence, out, args.model)
        print(f"block drafter written to {out}/ with its confidence head refitted on {r['sequences']} held-back "
              f"sequences ({r['inputs']}): BCE {r['bce_out_of_fold']:.3f} out of fold, {r['bce_joint_head']:.3f} "
              f"before, {r['bce_constant']:.3f} for a constant")
        return 0
    if args.kind == "dspark":
        from hal.training.dspark_train import run
        out = Path(args.out or f"{Path(args.model).stem}-dspark")
        s = run(args.model, out, args.minutes, block=args.block, layers=args.layers, taps=args.taps, rank=args.rank,
                draft_size=args.draft_vocab, seed=args.seed, max_new_tokens=args.max_new_tokens, limit=args.limit,
                sets=args.prompt_sets,
                batch=args.batch, lr=args.lr, distill=args.distill, layout=args.layout, mask_token=args.mask_token)
        print(f"block drafter written to {out}/ (model.safetensors, config.json, loss.png, train.json): "
              f"{s['steps']} steps, validation tau {s['val']['tau']:.3f}, top-1 {s['val']['top1']:.3f}")
        return 0
    from hal.training.eagle_train import run_eagle
    out = Path(args.out or f"{Path(args.model).stem}-eagle3")
    s = run_eagle(args.model, out, args.minutes, draft_size=args.draft_vocab, sets=args.prompt_sets,
                  max_new_tokens=args.max_new_tokens, limit=args.limit, batch=args.batch, lr=args.lr, seed=args.seed,
                  init=args.init)
    print(f"EAGLE-3 head written to {out}/ (model.safetensors and config.json in SafeAILab's layout, loss.png, "
          f"train.json): {s['steps']} steps, validation top-1 {[round(x, 3) for x in s['val']['top1']]}, "
          f"tau {s['val']['tau']:.3f}")
    return 0


def add_train_head(sub) -> None:
    """The ``train-head`` subcommand's flags."""
    th = sub.add_parser("train-head", help="train an EAGLE head or a DSpark block drafter by self-distillation "
                                           "(CPU; needs tqdm and matplotlib: pip install 'spec-hal[train]')")
    th.add_argument("--kind", choices=("eagle", "dspark"), default="eagle",
                    help="eagle: a one-layer EAGLE-3 head, written in SafeAILab's layout; dspark: a block drafter "
                         "(data for both cached under $HAL_CACHE/dspark)")
    th.add_argument("--block", type=bounded(int, 2, 64), default=8, help="dspark: the block size B (B proposals in DeepSpec's layout, B - 1 in the others)")
    th.add_argument("--layers", type=bounded(int, 1, 8), default=2, help="dspark: draft layers")
    th.add_argument("--taps", type=taps_flag, default=(1, 8, 16, 24, 29),  # the layer count: the last layer's output
                    help="dspark: increasing target layers (of block_data.CANDIDATE_TAPS) whose inputs are features")
    th.add_argument("--rank", type=bounded(int, 1, 512), default=32, help="dspark: the Markov head's rank")
    th.add_argument("--layout", choices=("dspark", "dflash"), default="dspark",  # dspark_train.LAYOUTS
                    help="dspark: the architecture trained and written: DeepSpec's published DSpark (Qwen3DSparkModel) "
                         "or z-lab's DFlash (DFlashDraftModel), both Qwen3 layers (a --draft-vocab below the target's "
                         "is written as token_map.pt, as SGLang's --speculative-token-map reads it)")
    th.add_argument("--init", metavar="FOLDER", help="eagle: continue training the EAGLE-3 head in FOLDER")
    th.add_argument("--mask-token", type=int, help="dspark, dflash: the token whose embedding the mask rows are "
                                                   "(default: the target's first stop id)")
    th.add_argument("--distill", type=bounded(float, 0.0, 1.0), default=0.0,
                    help="dspark: the cross-entropy's share against the target's soft labels, not its greedy token")
    th.add_argument("--refit-confidence", metavar="FOLDER",
                    help="dspark: no training; refit the confidence head of FOLDER (a DSpark drafter train-head wrote) "
                         "on its held-back sequences, to --out")
    th.add_argument("--model", default="smollm2-135m", help="a fetchable name or a .gguf path")
    th.add_argument("--minutes", type=float, default=40.0, help="training time (data made first, cached in $HAL_CACHE)")
    th.add_argument("--out", help="output folder (default: <model>-eagle3 or <model>-dspark)")
    th.add_argument("--draft-vocab", type=int, default=8192, help="the head's vocabulary: the N most frequent ids")
    th.add_argument("--max-new-tokens", type=int, default=128, help="response length when generating the data")
    th.add_argument("--limit", type=int, help="only the first N prompts (a quick run)")
    th.add_argument("--prompt-sets", type=int, choices=(1, 2, 3), default=2,
                    help="how many of hal.training.data's prompt sets (the cache is extended)")
    th.add_argument("--batch", type=int, default=8, help="sequences per step")
    th.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; warm-up, then cosine)")
    th.add_argument("--seed", type=int, default=0)


def refit_folder(folder, out, model: str = "smollm2-135m") -> dict:
    """``spec-hal train-head --kind dspark --refit-confidence FOLDER``: the DSpark drafter of
    ``folder`` with its confidence head refitted on its own validation split (the data cache of
    `hal.training.block_data` and the seed in its train.json, so the same sequences its
    training held back), written to ``out`` in the same layout (config.json, model.safetensors,
    token map, train.json with the report under "confidence"; README.md and loss.png copied).
    Returns the report."""
    import hashlib
    import json
    import shutil
    from pathlib import Path

    from hal.errors import HalError
    from hal.models.block_layouts import read_block, read_layout, read_tensors, rewrite
    from hal.models.dspark import Confidence
    from hal.training import block_data
    from hal.training.block_data import CANDIDATE_TAPS, BlockData, to_draft_of
    from hal.training.dspark_train import refit_on
    from hal.training.confidence import readme_line
    folder, out = Path(folder), Path(out)
    try:
        cfg = read_layout(folder).cfg
    except HalError as e:
        raise HalError(f"--refit-confidence: expected a DSpark drafter's folder, got {e}", arg="--refit-confidence"
                       ) from None
    if cfg.confidence == Confidence.NONE:
        raise HalError(f"--refit-confidence: expected a drafter with a confidence head, got {str(folder)!r} without "
                       f"one", arg="--refit-confidence")
    if any(t not in CANDIDATE_TAPS for t in cfg.taps):
        raise HalError(f"--refit-confidence: expected taps the data records ({list(CANDIDATE_TAPS)}), got "
                       f"{list(cfg.taps)}", arg="--refit-confidence")
    meta = folder / "train.json"
    if not meta.is_file():
        raise HalError(f"--refit-confidence: expected a trained drafter's folder with train.json (its seed), got "
                       f"{str(folder)!r}", arg="--refit-confidence")
    summary = json.loads(meta.read_text())
    target, tok = block_data.load_target(model, None, None)
    layout, cfg, w = read_block(folder, target)
    blob = block_data.responses(model, 128, None, target, tok, sets=int(summary.get("prompt_sets", 2)))
    feats = block_data.tapped(model, blob, target)
    d = BlockData(blob, feats, [CANDIDATE_TAPS.index(t) for t in cfg.taps], cfg.draft_vocab, target.cfg.stop_ids,
                  int(summary.get("seed", 0)))
    conf, bias, report = refit_on(cfg, w, d, to_draft_of(w["draft_ids"], target.cfg.vocab), target,
                                  layout.mask_token)
    report["data_made"] = blob.get("made")
    sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    readme = (folder / "README.md").read_text() if (folder / "README.md").is_file() else None
    raw = read_tensors(folder)
    rewrite(folder, out, raw | {"confidence_head.proj.weight": conf[None].to(raw["confidence_head.proj.weight"].dtype),
                                "confidence_head.proj.bias": bias.to(raw["confidence_head.proj.bias"].dtype)})
    (out / "train.json").write_text(json.dumps({**summary, "confidence": report}, indent=1) + "\n")
    if (folder / "loss.png").is_file() and folder.resolve() != out.resolve():
        shutil.copy(folder / "loss.png", out / "loss.png")
    if readme is not None:
        new = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        kept = [line for line in readme.replace(sha, new).splitlines() if not line.startswith("- Confidence head:")]
        (out / "README.md").write_text("\n".join(kept) + "\n" + readme_line(report, refitted=str(folder)))
    return report
