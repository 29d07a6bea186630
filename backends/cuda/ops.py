"""The cuda backend's ops: one Triton kernel file per op (the names of verify_ops/), each
launcher registered as a ``torch.library`` custom op (``spec_hal_cuda::<op>``,
`hal.library`: the contract's fake kernels and mutated arguments), so ``torch.compile`` and
CUDA-graph capture treat it as one opaque op. Registered once, when the backend is loaded."""

from backends.cuda.copy_kv import copy_kv
from backends.cuda.greedy import verify_greedy
from backends.cuda.ngram import ngram_propose
from backends.cuda.paged_attention import paged_attention
from backends.cuda.rejection import verify_rejection
from backends.cuda.sample import sample
from backends.cuda.tree import verify_tree
from backends.cuda.typical import verify_typical
from backends.cuda.write_kv import write_kv
from hal.library import register

_ops = register("spec_hal_cuda", {
    "sample": sample, "ngram_propose": ngram_propose, "verify_greedy": verify_greedy,
    "verify_rejection": verify_rejection, "verify_typical": verify_typical, "verify_tree": verify_tree,
    "write_kv": write_kv, "paged_attention": paged_attention, "copy_kv": copy_kv})
(copy_kv, ngram_propose, paged_attention, sample, verify_greedy, verify_rejection, verify_tree, verify_typical,
 write_kv) = (_ops.copy_kv, _ops.ngram_propose, _ops.paged_attention, _ops.sample, _ops.verify_greedy,
              _ops.verify_rejection, _ops.verify_tree, _ops.verify_typical, _ops.write_kv)

__all__ = ["copy_kv", "ngram_propose", "paged_attention", "sample", "verify_greedy", "verify_rejection",
           "verify_tree", "verify_typical", "write_kv"]
