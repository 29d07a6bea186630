"""The typed launch config (issue 67, item 4): every entry point validates its flags once into a
frozen `LaunchConfig`, and the start-up reads only that; a flag an entry point lacks is an
error naming it, never a default found by ``getattr``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hal.errors import HalError
from hal.launch.config import SERVE_BUDGET, LaunchConfig
from hal.launch.flags import add_engine_args


def namespace(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    return ap.parse_args(list(argv))


def test_the_shared_flags_give_every_field():
    c = LaunchConfig.from_args(namespace("--draft", "self:2", "--k", "3", "--no-route", "--no-batch-invariant"),
                               max_context=512, max_num_seqs=8, max_num_batched_tokens=SERVE_BUDGET)
    assert (c.draft, c.k, c.route, c.batch_invariant, c.max_context, c.max_num_seqs) == ("self:2", 3, False, False,
                                                                                       512, 8)
    assert c.max_num_batched_tokens == SERVE_BUDGET and c.enable_prefix_caching is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.k = 4


def test_a_flag_the_entry_point_lacks_is_an_error_not_a_default():
    args = namespace()
    del args.draft_thread
    with pytest.raises(HalError, match="draft_thread: expected the entry point's flags to set it"):
        LaunchConfig.from_args(args, max_context=512, max_num_seqs=8, max_num_batched_tokens=None)


@pytest.mark.parametrize("field,value", [("max_context", 1), ("max_num_seqs", 0), ("max_num_batched_tokens", 0),
                                         ("max_num_batched_tokens", "some"), ("max_num_seqs", True)])
def test_bad_values_are_refused_once(field, value):
    given = {"max_context": 512, "max_num_seqs": 8, "max_num_batched_tokens": None, field: value}
    with pytest.raises(HalError, match=f"^{field}: expected"):
        LaunchConfig.from_args(namespace(), **given)


def test_bad_row_codes_are_refused_naming_the_field():
    import dataclasses
    c = LaunchConfig.from_args(namespace(), max_context=512, max_num_seqs=8, max_num_batched_tokens=None)
    assert c.row_codes == "auto"
    with pytest.raises(HalError, match="^row_codes: expected one of"):
        dataclasses.replace(c, row_codes="3")
