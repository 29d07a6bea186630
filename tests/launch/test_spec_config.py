"""``--speculative-config`` (`hal.launch.spec_config`): vLLM's JSON form maps onto ``--draft``
and ``--k``; every key spec-hal cannot honour is refused by name, and the flag never mixes
with the flags it sets."""

from __future__ import annotations

import argparse
import json

import pytest

from hal.checks import MAX_K
from hal.errors import HalError
from hal.launch.flags import add_engine_args
from hal.launch.spec_config import SpeculativeConfig, parse_speculative_config


def parse(cfg) -> SpeculativeConfig:
    return parse_speculative_config(json.dumps(cfg), MAX_K)


@pytest.mark.parametrize("cfg, draft, k", [
    ({"method": "ngram", "num_speculative_tokens": 4}, "ngram", 4),
    ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, "ngram", None),
    ({"method": "dspark", "num_speculative_tokens": 7}, "dspark", 7),
    ({"method": "dspark", "model": "/x/block"}, "dspark:/x/block", None),
    ({"method": "eagle3", "model": "/x/head", "num_speculative_tokens": 0}, "eagle:/x/head", 0),
    ({"method": "eagle"}, "eagle", None),
    ({"method": "draft_model", "model": "/x/small.gguf"}, "model:/x/small.gguf", None),
    ({"method": "ngram+dspark"}, "ngram+dspark", None),
    ({"method": "self"}, "self", None),
])
def test_vllm_methods_and_our_kinds_map_onto_draft_and_k(cfg, draft, k):
    assert parse(cfg) == SpeculativeConfig(draft, k)


@pytest.mark.parametrize("text, match", [
    ("{not json", "expected a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ('{"method": "dspark", "draft_tensor_parallel_size": 2}', "key: expected one of method, .*got 'draft_tensor"),
    ('{"method": "medusa"}', "method: expected one of .*got 'medusa'"),
    ('{"method": "none"}', "method: expected one of .*got 'none'"),
    ('{"num_speculative_tokens": 3}', "method: expected one of .*got None"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens: expected an int in"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens: expected an int in"),
    ('{"method": "ngram", "num_speculative_tokens": 4.0}', "num_speculative_tokens: expected an int in"),
    (f'{{"method": "ngram", "num_speculative_tokens": {MAX_K + 1}}}', "num_speculative_tokens: expected an int in"),
    ('{"method": "ngram", "prompt_lookup_max": 5}', "prompt_lookup_max: expected 3 with an n-gram method"),
    ('{"method": "eagle", "prompt_lookup_min": 1}', "prompt_lookup_min: expected 1 with an n-gram method"),
    ('{"method": "draft_model"}', "model: expected the drafter's path with method 'draft_model'"),
    ('{"method": "ngram", "model": "/x"}', "model: expected nothing with method 'ngram'"),
    ('{"method": "eagle", "model": 3}', "model: expected a path"),
])
def test_what_cannot_be_honoured_is_refused_by_name(text, match):
    with pytest.raises(HalError, match=match) as e:
        parse_speculative_config(text, MAX_K)
    assert e.value.arg == "--speculative-config"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    return ap


def test_the_flag_sets_draft_and_k_and_refuses_them_beside_it(capsys):
    args = parser().parse_args(["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 5}'])
    assert (args.draft, args.k) == ("dspark", 5)
    args = parser().parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert (args.draft, args.k) == ("ngram", 8)          # --k's default kept
    plain = parser().parse_args([])
    assert (plain.draft, plain.k, plain.speculative_config) == ("ngram", 8, None)
    for argv, flag in ((["--speculative-config", '{"method": "dspark"}', "--draft", "eagle"], "--draft"),
                       (["--k", "3", "--speculative-config", '{"method": "dspark"}'], "--speculative-config"),
                       (["--speculative-config", '{"method": "eagle", "model": "/no/such/head"}'],
                        "--speculative-config")):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(argv)
        assert e.value.code == 2
        assert f"argument {flag}:" in capsys.readouterr().err
