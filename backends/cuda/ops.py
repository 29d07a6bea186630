"""The cuda backend's ops: one Triton kernel file per op (the names of verify_ops/), each
launcher registered as a ``torch.library`` custom op (``spec_hal_cuda::<op>``,
`hal.library`: the contract's fake kernels and mutated arguments), so ``torch.compile`` and
CUDA-graph capture treat it as one opaque op. Registered once, when the backend is loaded."""

from backends.cuda.copy_kv import copy_kv
from backends.cuda.greedy import verify_greedy
from backends.cuda.logits import process_logits
from backends.cuda.ngram import ngram_propose
from backends.cuda.paged_attention import paged_attention
from backends.cuda.rejection import verify_rejection
from backends.cuda.rejection_logits import verify_rejection_logits
from backends.cuda.sample import sample
from backends.cuda.tree import verify_tree
from backends.cuda.typical import verify_typical
from backends.cuda.write_kv import write_kv
from hal.library import register_module

register_module("spec_hal_cuda", globals())   # each op imported above becomes spec_hal_cuda::<op>

__all__ = ["copy_kv", "ngram_propose", "paged_attention", "process_logits", "sample", "verify_greedy", "verify_rejection",
           "verify_rejection_logits", "verify_tree", "verify_typical", "write_kv"]
