"""The EAGLE head shipped for SmolLM2-135M is in SafeAILab's published EAGLE-3 layout: read
(`read_head`) and written back (`write_eagle3`), every tensor and the config are the same, so its
drafts are too; SafeAILab's code reads that layout (`scripts/oracles/eagle3_written_check.py`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hal.models.eagle import shipped_head
from hal.models.eagle_layouts import read_head, write_eagle3

LAYERS, VOCAB = 30, 49152   # SmolLM2-135M


def test_the_shipped_eagle_head_round_trips_through_the_published_layout(tmp_path):
    folder = shipped_head("smollm2-135m")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "rope_theta" not in config
    cfg, w = read_head(folder, LAYERS)
    assert cfg.version == 3 and cfg.feature_layers == (2, 15, 27) and cfg.draft_vocab == 8192
    write_eagle3(tmp_path, cfg, w, VOCAB, LAYERS)
    ours, shipped = load_file(str(tmp_path / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert set(ours) == set(shipped)
    assert all(ours[n].dtype == shipped[n].dtype and torch.equal(ours[n], shipped[n]) for n in shipped)
    assert json.loads((tmp_path / "config.json").read_text()) == config


def test_the_shipped_dspark_drafter_exported_whole_drafts_what_it_drafts(tmp_path):
    """The shipped block drafter is DeepSpec's ``Qwen3DSparkModel`` layout less its copies of the
    target's embeddings and lm_head; ``spec-hal model export-drafter dspark`` writes them back
    (DeepSpec's own loader reads that: `scripts/oracles/dspark_written_check.py`). The exported
    folder proposes what the shipped one does, token for token and probability for probability,
    and greedy decoding with it equals plain decoding."""
    import hal
    from hal.drafters.dspark import DSparkDrafter
    from hal.engine import Request, SpeculativeDecoder
    from hal.models.block_layouts import load_block
    from hal.models.dspark import shipped_block
    from hal.models.export import export_drafter
    from tests.engine.test_real_model import load_real
    target, tok = load_real()
    folder = shipped_block("smollm2-135m")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 7
    shipped = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in shipped and "lm_head.weight" not in shipped
    out = export_drafter("dspark", "smollm2-135m", tmp_path / "whole", hal.get_backend("cpu"))
    whole = load_file(str(out / "model.safetensors"))
    assert torch.equal(whole.pop("embed_tokens.weight"), target.embed)
    assert torch.equal(whole.pop("lm_head.weight"), target.head)
    assert set(whole) == set(shipped) and all(torch.equal(whole[n], shipped[n]) for n in shipped)
    assert json.loads((out / "config.json").read_text()) == config
    assert torch.equal(torch.load(out / "token_map.pt"), torch.load(folder / "token_map.pt"))
    ids = tok.encode("<|im_start|>user\nTell me about the history of the bicycle.<|im_end|>\n"
                     "<|im_start|>assistant\n").ids
    runs = []
    for drafter in (None, DSparkDrafter(load_block(folder, target)), DSparkDrafter(load_block(out, target))):
        dec = SpeculativeDecoder(target, drafter, num_blocks=64)
        got = dec.generate([Request(ids, max_new_tokens=32, k=7 if drafter else 0, stop_ids=(2,))])[0]
        runs.append((got, dec.metrics.total.accepted_per_position, dec.metrics.total.drafts_per_position))
    assert runs[1] == runs[2] and runs[1][0] == runs[0][0]
    assert sum(runs[1][1]) > 0   # it drafts something the target takes
    with pytest.raises(hal.HalError, match="--out: expected a new or empty folder"):
        export_drafter("dspark", "smollm2-135m", out, hal.get_backend("cpu"))
