"""The cuda backend's ops: one Triton kernel file per op (the names of verify_ops/), each
launcher registered here as a ``torch.library`` custom op (``spec_hal_cuda::<op>``) with a
fake (meta) kernel and its mutated arguments, so ``torch.compile`` and CUDA-graph capture
treat it as one opaque op. Registered once, when the backend is loaded."""

from __future__ import annotations

import torch
from torch import Tensor

from backends.cuda import copy_kv as _copy_kv
from backends.cuda import greedy as _greedy
from backends.cuda import ngram as _ngram
from backends.cuda import paged_attention as _paged_attention
from backends.cuda import rejection as _rejection
from backends.cuda import sample as _sample
from backends.cuda import tree as _tree
from backends.cuda import typical as _typical
from backends.cuda import write_kv as _write_kv

NS = "spec_hal_cuda"
I32 = dict(dtype=torch.int32)


def _verify_fake(draft_token_ids, cu_num_draft_tokens, *rest):  # rest = (max_k,)
    R, max_k = cu_num_draft_tokens.shape[0] - 1, rest[0]
    return draft_token_ids.new_empty((R, max_k + 1), **I32), draft_token_ids.new_empty((R,), **I32)


@torch.library.custom_op(f"{NS}::sample", mutates_args=())
def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           offsets: Tensor) -> tuple[Tensor, Tensor]:
    return _sample.sample(logits, temperature, top_k, top_p, seeds, offsets)


@sample.register_fake
def _(logits, temperature, top_k, top_p, seeds, offsets):
    R, V = logits.shape
    return logits.new_empty((R,), **I32), logits.new_empty((R, V), dtype=torch.float32)


@torch.library.custom_op(f"{NS}::ngram_propose", mutates_args=())
def ngram_propose(token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int, k: int) -> tuple[Tensor, Tensor]:
    return _ngram.ngram_propose(token_ids, num_tokens, min_n, max_n, k)


@ngram_propose.register_fake
def _(token_ids, num_tokens, min_n, max_n, k):
    R = token_ids.shape[0]
    return token_ids.new_empty((R, k), **I32), token_ids.new_empty((R,), **I32)


@torch.library.custom_op(f"{NS}::verify_greedy", mutates_args=())
def verify_greedy(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_logits: Tensor,
                  max_k: int) -> tuple[Tensor, Tensor]:
    return _greedy.verify_greedy(draft_token_ids, cu_num_draft_tokens, target_logits, max_k)


verify_greedy.register_fake(lambda ids, cu, logits, max_k: _verify_fake(ids, cu, max_k))


@torch.library.custom_op(f"{NS}::verify_rejection", mutates_args=())
def verify_rejection(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                     target_probs: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _rejection.verify_rejection(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, seeds,
                                       offsets, max_k)


verify_rejection.register_fake(lambda ids, cu, q, p, s, o, max_k: _verify_fake(ids, cu, max_k))


@torch.library.custom_op(f"{NS}::verify_typical", mutates_args=())
def verify_typical(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_probs: Tensor, seeds: Tensor,
                   offsets: Tensor, max_k: int, posterior_threshold: float,
                   posterior_alpha: float) -> tuple[Tensor, Tensor]:
    return _typical.verify_typical(draft_token_ids, cu_num_draft_tokens, target_probs, seeds, offsets, max_k,
                                   posterior_threshold, posterior_alpha)


verify_typical.register_fake(lambda ids, cu, p, s, o, max_k, eps, delta: _verify_fake(ids, cu, max_k))


@torch.library.custom_op(f"{NS}::verify_tree", mutates_args=())
def verify_tree(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor, target: Tensor,
                draft_probs: Tensor | None, seeds: Tensor | None, offsets: Tensor | None,
                max_k: int) -> tuple[Tensor, Tensor, Tensor]:
    return _tree.verify_tree(draft_token_ids, cu_num_draft_tokens, parent_ids, target, draft_probs, seeds, offsets,
                             max_k)


@verify_tree.register_fake
def _(draft_token_ids, cu_num_draft_tokens, parent_ids, target, draft_probs, seeds, offsets, max_k):
    R = cu_num_draft_tokens.shape[0] - 1
    return (target.new_empty((R, max_k + 1), **I32), target.new_empty((R, max_k), **I32),
            target.new_empty((R,), **I32))


@torch.library.custom_op(f"{NS}::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _write_kv.write_kv(key, value, k_cache, v_cache, slot_mapping)


write_kv.register_fake(lambda key, value, k_cache, v_cache, slot_mapping: None)


@torch.library.custom_op(f"{NS}::paged_attention", mutates_args=())
def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float, tree_mask: Tensor | None) -> Tensor:
    return _paged_attention.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                            scale, tree_mask)


paged_attention.register_fake(lambda query, *rest: torch.empty_like(query))


@torch.library.custom_op(f"{NS}::copy_kv", mutates_args=("k_cache", "v_cache"))
def copy_kv(k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    _copy_kv.copy_kv(k_cache, v_cache, src_slots, dst_slots)


copy_kv.register_fake(lambda k_cache, v_cache, src_slots, dst_slots: None)

__all__ = ["copy_kv", "ngram_propose", "paged_attention", "sample", "verify_greedy", "verify_rejection",
           "verify_tree", "verify_typical", "write_kv"]
