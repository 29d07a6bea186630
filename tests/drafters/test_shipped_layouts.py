"""The EAGLE head shipped for SmolLM2-135M is in SafeAILab's published EAGLE-3 layout: read
(`read_head`) and written back (`write_eagle3`), every tensor and the config are the same, so its
drafts are too; SafeAILab's code reads that layout (`scripts/oracles/eagle3_written_check.py`)."""

from __future__ import annotations

import json

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
