"""ngram_propose: vLLM's prompt-lookup semantics, batched."""

import pytest
import torch

from hal.conformance._helpers import host, put

pytestmark = pytest.mark.hal_op("ngram_propose")


def spec(tokens, min_n, max_n, k):
    """Longest suffix n-gram (min_n..max_n) seen earlier, earliest occurrence."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for e in range(n - 1, L - 1):          # occurrence ending at e, before the last token
            if tokens[e - n + 1: e + 1] == suffix:
                return tokens[e + 1: e + 1 + k]
    return []


def run(be, histories, min_n, max_n, k):
    L = max(1, max(map(len, histories)))
    ids = torch.full((len(histories), L), 0, dtype=torch.long)
    for r, h in enumerate(histories):
        ids[r, :len(h)] = torch.tensor(h, dtype=torch.long)
    num = torch.tensor([len(h) for h in histories], dtype=torch.int32)
    drafts, n = host(*be.ngram_propose(*put(be, ids, num), min_n, max_n, k))
    assert drafts.shape == (len(histories), k) and drafts.dtype == torch.int32 and n.dtype == torch.int32
    return [drafts[r, : int(n[r])].tolist() for r in range(len(histories))], drafts, n


def test_vllm_example(backend):
    got, drafts, n = run(backend, [[1, 2, 3, 4, 2, 3]], 2, 3, 4)
    assert got == [[4, 2, 3]] and drafts[0, 3] == -1


def test_cases(backend):
    hist = [
        [1, 2, 3, 4, 2, 3],          # [4, 2, 3]
        [5, 6, 7, 8],                # no match
        [9, 9, 9, 9],                # overlapping: [9, 9, 9] ends at 2 -> only [9] follows
        [1, 2, 1, 2, 3, 1, 2],       # longest [1, 2] (n=2; [2,1,2]? no) earliest -> [1, 2, 3]
        [3],                         # shorter than min_n
        [],                          # empty history
        [4, 1, 2, 3, 5, 1, 2, 3, 6, 2, 3],  # n=3? [6,2,3] no; [2,3] earliest at 2 -> [5, 1]
    ]
    got, _, _ = run(backend, hist, 2, 3, 2)
    assert got == [spec(h, 2, 3, 2) for h in hist]
    assert got == [[4, 2], [], [9], [1, 2], [], [], [5, 1]]


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 3), (2, 4, 5), (1, 3, 1), (3, 5, 4)])
def test_matches_definition_on_random_histories(backend, min_n, max_n, k):
    g = torch.Generator().manual_seed(51 + min_n * 10 + max_n)
    hist = [[int(t) for t in torch.randint(0, 3, (int(torch.randint(0, 40, (), generator=g)),), generator=g)]
            for _ in range(64)]
    got, _, _ = run(backend, hist, min_n, max_n, k)
    assert got == [spec(h, min_n, max_n, k) for h in hist]
