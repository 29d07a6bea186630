"""The op contract: every backend provides these functions, with these names,
signatures and semantics. `hal.Backend` validates arguments before calling them,
so an implementation may assume well-formed input.

Conventions shared by the verify ops
------------------------------------
* A batch holds ``R`` requests. Drafts are ragged, in CSR form:
  ``draft_token_ids`` is ``[N]`` (int32 or int64) and ``cu_num_draft_tokens``
  is ``[R+1]`` (int32 or int64) with ``cu[0] == 0`` and
  ``k_r = cu[r+1] - cu[r]`` drafts for request ``r`` (FlashInfer's indptr).
* Target rows: request ``r`` owns the ``k_r + 1`` rows
  ``cu[r] + r ... cu[r+1] + r`` of a ``[N + R, V]`` target tensor. Row
  ``cu[r] + r + j`` is the target's distribution for the token at draft
  position ``j``; the last one is the bonus position. This is exactly the
  flattened output of a verify forward pass over ``[last token, drafts...]``.
* ``draft_probs``, when given, is ``[N, V]``: row ``cu[r] + j`` is the
  distribution that draft ``j`` of request ``r`` was sampled from.
* ``max_k`` (a Python int) is an upper bound of every ``k_r``; it fixes the
  output width without a device-to-host sync.
* Output tokens are ``[R, max_k + 1]`` int32 padded with -1: the accepted
  draft prefix followed by exactly one more token (the recovered token at the
  first rejection, or the bonus token when every draft was accepted).
  ``num_accepted`` is ``[R]`` int32, the length of the accepted prefix. A
  request with 0 drafts is valid and yields the bonus token only.
* Randomness: each request has an int64 ``seed`` and an int64 ``offset``
  (its step counter). A backend derives all random numbers of a request from
  ``(seed, offset)`` alone, so the same seed, offset and inputs give the same
  output on a given backend, and a request's output does not depend on the
  other requests in the batch. Ops draw from disjoint streams, so `sample` and
  `verify_rejection` at the same offset are independent; callers advance
  ``offset`` for every `sample` call they make for a request. Backends need
  not produce the same random draws as each other.
* Probability inputs must be finite, non-negative and sum to 1 per row within
  ``hal.checks.PROB_SUM_ATOL`` (1e-3 for fp32/fp64, 1e-2 for fp16/bf16).
  They are used exactly as given: never renormalised and never clamped. So a
  ``q(x)`` slightly above 1 (allowed by that tolerance) is used literally in
  ``u * q(x) < p(x)``, as vLLM's rejection sampler does (SGLang caps q at 1;
  we do not). Logits may hold -inf (masked tokens) but not NaN or +inf.
* Layout: any strides are accepted, for every tensor argument (views,
  transposes, slices with steps, expanded dims). A backend either reads the
  strides or makes the argument contiguous; the result equals the result on
  contiguous copies. In-place outputs (the KV caches) are updated in place
  whatever their strides (head-padded caches included).
* Sizes: ``max_k`` and ``k`` are at most ``hal.checks.MAX_K`` (1024),
  ``min_n`` / ``max_n`` at most ``hal.checks.MAX_NGRAM`` (1024); larger
  values are refused with `hal.HalError`. Empty batches (``R = 0``, ``T = 0``,
  ``N = 0``, an empty history) are valid and give empty (or all-padding)
  outputs.
* Argmax is taken over values rounded to float32 (bf16/fp16 are exact there;
  fp64 is rounded), and ties go to the lowest token id.

KV cache
--------
Layout NHD: ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``. A slot is ``block * block_size + offset``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol, runtime_checkable

from torch import Tensor

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy (vLLM's ``_SAMPLING_EPS``): 1 / T would overflow."""


@runtime_checkable
class Ops(Protocol):
    """The functions a backend's op module provides."""

    def sample(self, logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
               seeds: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Sample one token per row, returning the distribution actually sampled from.

        :param logits: ``[R, V]`` float logits.
        :param temperature: ``[R]`` float32, ``>= 0``; 0, and anything below
            `SAMPLING_EPS` (1e-5), means greedy.
        :param top_k: ``[R]`` int32; keep tokens whose logit is at least the
            ``top_k``-th largest (ties at the cutoff are kept, as in vLLM).
            ``top_k < 1`` or ``>= V`` disables it (vLLM uses -1 or 0).
        :param top_p: ``[R]`` float32 in ``(0, 1]``; keep the smallest set of
            most likely tokens whose mass reaches ``top_p`` (after top-k,
            renormalised; ties at the cutoff kept). 1 disables it.
        :param seeds: ``[R]`` int64. :param offsets: ``[R]`` int64, ``>= 0``.
        :returns: ``(tokens [R] int32, q [R, V] float32)``. ``q`` is
            ``softmax(filtered((logits - max) / temperature))`` (the max taken
            first, so finite logits near the float32 limits never overflow);
            for a greedy row it is one-hot at the argmax (lowest id on ties) and
            the token is that argmax. Filtered-out tokens have ``q == 0`` exactly.
            The draw is exact for the whole distribution: a token whose weight
            is ``w`` times the largest is drawn at its rate at least down to
            ``w ~ 1e-12`` (the long tail is not cut off by the 24 bits of a
            float32 uniform). The same holds for every token an op samples.
        """

    def ngram_propose(self, token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int,
                      k: int) -> tuple[Tensor, Tensor]:
        """Prompt-lookup drafting over each request's token history (vLLM semantics).

        Finds the longest suffix n-gram, ``min_n <= n <= max_n``, of
        ``token_ids[r, :num_tokens[r]]`` that also occurs earlier (ending
        before the last token; overlap with the suffix is allowed). Of the
        occurrences of that length, the earliest wins. Proposes up to ``k``
        tokens that followed it, fewer when the history ends first. Example:
        ``[1,2,3,4,2,3]``, min 2, max 3, k 4 gives ``[4,2,3]``.

        :param token_ids: ``[R, L]`` int32/int64 histories, right-padded.
        :param num_tokens: ``[R]`` int, ``0 <= num_tokens[r] <= L``.
        :param min_n: ``>= 1``. :param max_n: ``>= min_n``. :param k: ``>= 1``.
        :returns: ``(drafts [R, k] int32 padded with -1, num_drafts [R] int32)``.
        """

    def verify_greedy(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                      target_logits: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
        """Greedy verification: accept drafts while they equal the target argmax.

        :param target_logits: ``[N + R, V]`` float (see target rows above).
        :returns: ``(output_token_ids [R, max_k+1] int32, num_accepted [R] int32)``.
            Row ``r`` holds ``argmax`` of its target rows ``0..num_accepted[r]``
            (accepted drafts equal those argmaxes; the last one is the
            correction or the bonus token), then -1. Argmax ties go to the
            lowest token id; a row of all -inf yields token 0. Bit-identical on
            every backend.
        """

    def verify_rejection(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                         draft_probs: Tensor | None, target_probs: Tensor, seeds: Tensor,
                         offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
        """Speculative sampling (Leviathan et al., Chen et al.): exact in distribution.

        With ``p`` the target row and ``q`` the draft row at draft ``x``:
        accept iff ``u * q(x) < p(x)``, ``u ~ U(0, 1)``; so ``q(x) = 0 < p(x)``
        always accepts and ``p(x) = 0`` always rejects. At the first rejection
        the token is sampled from ``norm(max(p - q, 0))``; if that residual is
        all zero (only when ``p == q`` on the support) it is sampled from ``p``.
        After ``k_r`` acceptances the bonus token is sampled from ``p`` at row
        ``k_r``.

        :param draft_probs: ``[N, V]`` or ``None``. ``None`` means the drafts
            were deterministic (n-gram, greedy drafter), i.e. ``q`` one-hot at
            ``x``: accept with probability ``p(x)``, recover from ``p`` with
            ``x`` removed.
        :param target_probs: ``[N + R, V]`` float probabilities.
        :param seeds: ``[R]`` int64. :param offsets: ``[R]`` int64, ``>= 0``.
        :returns: ``(output_token_ids [R, max_k+1] int32, num_accepted [R] int32)``.
        """

    def verify_rejection_logits(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                                draft_probs: Tensor | None, target_logits: Tensor, temperature: Tensor,
                                seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
        """`verify_rejection` and `verify_greedy` from the target's *logits*, greedy and sampled
        requests mixed (the input vLLM's rejection sampler gets): no ``[N + R, V]`` softmax first.

        Request ``r`` is greedy when ``temperature[r] < SAMPLING_EPS``: its rows are verified
        exactly as `verify_greedy` (``draft_probs`` is ignored for it). Otherwise its target
        rows are ``p = softmax(target_logits[row] / temperature[r])`` (the row max subtracted
        first; a ``-inf`` logit gets ``p == 0`` exactly: mask tokens that top-k/top-p filter out
        to ``-inf`` beforehand), and acceptance, residual and bonus follow `verify_rejection`
        with those ``p`` (``u * q(x) < p(x)``, the same random streams). Each row is read for
        one logsumexp, which gives ``p(x)`` at the draft; the full row ``p`` (and the residual
        ``max(p - q, 0)``) is formed only at each request's first rejection, and at its bonus
        row only when every draft was accepted.

        :param draft_probs: ``[N, V]`` or ``None`` (one-hot ``q``, as in `verify_rejection`).
        :param target_logits: ``[N + R, V]`` float logits; no NaN or +inf, and a finite value
            in every row of a sampled request.
        :param temperature: ``[R]`` float32, finite, ``>= 0``.
        :param seeds: ``[R]`` int64. :param offsets: ``[R]`` int64, ``>= 0``.
        :returns: ``(output_token_ids [R, max_k+1] int32, num_accepted [R] int32)``.
        """

    def verify_typical(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                       target_probs: Tensor, seeds: Tensor, offsets: Tensor, max_k: int,
                       posterior_threshold: float, posterior_alpha: float) -> tuple[Tensor, Tensor]:
        """Medusa's typical acceptance. LOSSY: the output is not distributed as ``p``.

        Accept draft ``x`` iff ``p(x) > min(posterior_threshold,
        posterior_alpha * exp(-H(p)))`` with ``H`` the entropy (nats) of the
        target row. At the first rejection the token is ``argmax p`` (lowest
        id on ties, as vLLM's typical acceptance sampler); after ``k_r``
        acceptances the bonus token is sampled from ``p`` at row ``k_r``.
        With one-hot ``p`` it reduces to greedy verification.

        :param target_probs: ``[N + R, V]`` float probabilities.
        :param seeds: ``[R]`` int64 (bonus draws). :param offsets: ``[R]`` int64, ``>= 0``.
        :param posterior_threshold: epsilon, in ``(0, 1]``.
        :param posterior_alpha: delta, in ``(0, 1]``.
        :returns: ``(output_token_ids [R, max_k+1] int32, num_accepted [R] int32)``.
        """

    def verify_tree(self, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor,
                    target: Tensor, draft_probs: Tensor | None, seeds: Tensor | None,
                    offsets: Tensor | None, max_k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Tree verification (EAGLE / SpecInfer token trees).

        Request ``r`` drafts a tree of ``k_r`` nodes. ``parent_ids[cu[r] + i]``
        is the local index of node ``i``'s parent, ``-1`` for a child of the
        root (the last committed token); parents come before children
        (``parent < i``). Target row ``cu[r] + r`` is the root's distribution
        and row ``cu[r] + r + 1 + i`` the distribution after node ``i``. A chain
        is the tree ``parents = [-1, 0, 1, ...]``.

        Greedy mode (``seeds is None``): ``target`` holds scores (logits);
        starting at the root, accept the first child whose token equals the
        current row's argmax, repeat from it; the extra token is the argmax at
        the last accepted node. ``draft_probs`` must be ``None``.

        Sampling mode (``seeds``/``offsets`` given): ``target`` holds
        probabilities. Exact multi-draft recursive rejection sampling: at the
        current node, with residual ``r = p``, try its children in index
        order; child ``x`` with draft row ``q`` is accepted iff
        ``u * q(x) < r(x)``; after a rejection ``r = norm(max(r - q, 0))``
        (``p`` if all zero). ``draft_probs`` ``None`` means one-hot ``q``
        (deterministic drafts, e.g. top-k siblings). The extra token is
        sampled from the residual at the last accepted node (from ``p`` at a
        leaf). Exact when siblings are i.i.d. draws from their ``q`` or
        deterministic.

        :param parent_ids: ``[N]`` int32/int64, local parent index per node.
        :param target: ``[N + R, V]``: logits (greedy) or probabilities (sampling).
        :param draft_probs: ``[N, V]`` or ``None`` (sampling mode only).
        :param seeds: ``[R]`` int64 or ``None`` (greedy). :param offsets: likewise.
        :returns: ``(output_token_ids [R, max_k+1] int32, accepted_nodes
            [R, max_k] int32, num_accepted [R] int32)``: the accepted path's
            tokens then the extra token, padded with -1; the accepted path's
            local node indices, padded with -1; its length.
        """

    def process_logits(self, logits: Tensor, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                       parent_ids: Tensor | None, penalties: Tensor | None, token_counts: Tensor | None,
                       prompt_mask: Tensor | None, bias: Tensor | None, bad_words: Tensor | None,
                       bad_word_owner: Tensor | None, history: Tensor | None, stop_ids: Tensor | None,
                       min_tokens: Tensor | None, min_p: Tensor | None, max_k: int) -> Tensor:
        """Logits processors on the target rows before verification (vLLM's sampler order),
        each row seeing the drafts before it as generated output.

        Row ``j`` of request ``r`` (see target rows above) is the distribution after the
        drafts on its *path*: none for the root row, and for a row after node ``i`` that node
        and its ancestors (a chain's drafts ``0..j-1``; with ``parent_ids``, as in
        `verify_tree`). Every processor reads the request's state *plus its path*, so verifying
        ``k`` drafts gives each row exactly what plain decoding would have given after
        emitting those drafts. In this order, every group ``None`` when unused (host-known,
        so an unused processor costs nothing):

        1. ``bias``: ``[R, V]`` float32 added (OpenAI's ``logit_bias``); ``-inf`` where the
           request's allowed token ids exclude the token (vLLM's ``allowed_token_ids``).
        2. ``bad_words`` ``[W, L]`` int, each word right-aligned and left-padded with -1, and
           ``bad_word_owner`` ``[W]`` (its request): the word's last token is ``-inf`` in a row
           whose context ends with its other tokens. The context is ``history`` ``[R, H]``
           (the request's last generated tokens, right-aligned, -1 padded) followed by the
           row's path. A one-token word is banned everywhere (vLLM's ``bad_words``).
        3. ``stop_ids`` ``[R, S]`` (-1 padded) and ``min_tokens`` ``[R]`` (tokens still to
           generate before a stop token may come): ``-inf`` at the stop ids in rows whose
           path is shorter than ``min_tokens[r]``.
        4. ``penalties`` ``[R, 3]`` float32 ``(frequency, presence, repetition)`` (0, 0, 1:
           off), with ``token_counts`` ``[R, V]`` int (each token's count in the request's
           generated output so far) and ``prompt_mask`` ``[R, V]`` bool (tokens of its
           prompt). With ``c`` the row's counts (``token_counts`` plus its path):
           repetition divides positive logits and multiplies negative ones by ``rep`` where
           the token is in the prompt or ``c > 0``; then ``logit -= freq * c + pres * (c > 0)``.
        5. ``min_p`` ``[R, 2]`` float32 ``(min_p, temperature)``: for a sampled row
           (temperature at least `SAMPLING_EPS`, ``min_p > 0``) a token whose probability at
           that temperature is below ``min_p`` times the largest, i.e. whose logit is below
           ``max + temperature * log(min_p)`` (decided in float32), becomes ``-inf``.

        :param logits: ``[N + R, V]`` float target logits (not modified).
        :param parent_ids: ``None`` (chains) or ``[N]`` local parents as in `verify_tree`.
        :param max_k: an upper bound of every ``k_r`` (the longest path).
        :returns: ``[N + R, V]`` float32, the processed logits. Temperature, top-k and top-p
            are not applied here: they stay with the verify ops.
        """

    def write_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
        """Scatter new keys and values into the paged cache, in place.

        :param key: ``[T, Hkv, D]``. :param value: ``[T, Hkv, D]``, cast to the cache dtype.
        :param k_cache: ``[num_blocks, block_size, Hkv, D]``. :param v_cache: same shape.
        :param slot_mapping: ``[T]`` int32/int64; token ``t`` goes to slot
            ``slot_mapping[t]``; ``-1`` skips the token (padding) and leaves
            the cache untouched. Slots must be distinct (other than -1).
        """

    def paged_attention(self, query: Tensor, k_cache: Tensor, v_cache: Tensor,
                        block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                        scale: float, tree_mask: Tensor | None) -> Tensor:
        """Attention of ragged queries over the paged cache, with GQA.

        Request ``r`` has ``q_len = query_start_loc[r+1] - query_start_loc[r]``
        queries, the last ``q_len`` positions of its ``seq_lens[r]`` cached
        tokens (their KV already written): decode has ``q_len = 1``, verify
        ``k + 1``, prefill the whole prompt. Query ``i`` (local) sees context
        positions ``< seq_lens[r] - q_len`` and, causally, queries ``j <= i``;
        with ``tree_mask`` it instead sees query ``j`` iff
        ``tree_mask[query_start_loc[r] + i, j]`` (an ancestor or itself).
        Softmax in fp32, output in the query dtype.

        :param query: ``[T, Hq, D]``, ``Hq`` a multiple of ``Hkv``.
        :param block_tables: ``[R, max_blocks]`` int32: logical block ``b`` of
            request ``r`` is physical block ``block_tables[r, b]``.
        :param seq_lens: ``[R]`` int32/int64, ``>= q_len``.
        :param query_start_loc: ``[R+1]`` int32/int64 prefix sums, last = T.
        :param scale: softmax scale, usually ``D ** -0.5``.
        :param tree_mask: ``None`` or ``[T, max_q_len]`` bool.
        :returns: ``[T, Hq, D]`` in the query dtype.
        """

    def copy_kv(self, k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
        """Copy cache slots ``src_slots[i] -> dst_slots[i]`` in both caches, in place.

        All sources are read before any destination is written, so moving the
        accepted tree path down to contiguous slots is safe when ranges overlap.
        Destinations must be distinct.

        :param src_slots: ``[M]`` int32/int64. :param dst_slots: ``[M]``, same dtype.
        """


# The file each op lives in, the same in verify_ops/ and in every backends/<name>/.
OP_FILES: dict[str, str] = {
    "sample": "sample", "ngram_propose": "ngram", "verify_greedy": "greedy", "verify_rejection": "rejection",
    "verify_rejection_logits": "rejection_logits", "verify_typical": "typical", "verify_tree": "tree",
    "process_logits": "logits", "write_kv": "write_kv", "paged_attention": "paged_attention", "copy_kv": "copy_kv",
}

OP_NAMES: tuple[str, ...] = tuple(n for n in vars(Ops) if not n.startswith("_")
                                  and callable(getattr(Ops, n)))


def cumulative(counts) -> list[int]:
    """``[0, c0, c0 + c1, ...]``: row i's items are ``[out[i], out[i + 1])`` (``len(counts) + 1`` values,
    the host form of ``cu_num_draft_tokens``)."""
    return list(accumulate(counts, initial=0))
