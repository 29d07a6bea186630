"""The router's host lookup (`hal.engine.lookup.LookupIndex`) finds what the backend's
``ngram_propose`` finds, on random histories grown token by token."""

import random

import pytest
import torch

import hal
from hal.engine.lookup import LookupIndex
from hal.errors import HalError


@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 4), (3, 3)])
def test_the_index_matches_the_backend_op_as_a_history_grows(min_n, max_n):
    be, rng = hal.get_backend("cpu"), random.Random(min_n * 10 + max_n)
    for trial in range(12):
        vocab = rng.choice([2, 3, 5, 50])
        index, tokens = LookupIndex(min_n, max_n), []
        for _ in range(rng.randint(1, 60)):
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5]))]
            index.update(tokens)
            d, n = be.ngram_propose(torch.tensor([tokens]), torch.tensor([len(tokens)]), min_n, max_n, 3)
            found = index.match(tokens)
            assert (found is not None) == (int(n[0]) > 0), (tokens, found, n)
            if found is not None:   # the same occurrence: the same first draft
                length, e = found
                assert tokens[e + 1] == int(d[0, 0]) and tokens[e + 1 - length:e + 1] == tokens[-length:], (tokens, e, d)


def test_a_history_that_is_not_an_extension_is_indexed_afresh():
    index = LookupIndex(1, 2)
    index.update([1, 2, 3, 1])
    assert index.match([1, 2, 3, 1]) == (1, 0)
    index.update([4, 5, 4])
    assert index.match([4, 5, 4]) == (1, 0) and index.match([4, 5, 4, 9]) is None


def test_bad_lengths_are_refused():
    with pytest.raises(HalError, match="min_n, max_n"):
        LookupIndex(3, 2)
