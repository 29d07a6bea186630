"""The cpu backend's ops: the reference implementations (one file per op in verify_ops/),
each registered as a ``torch.library`` custom op (``spec_hal_cpu::<op>``, `hal.library`),
so a decode step over them compiles with ``torch.compile(fullgraph=True)``. Registered
once, when the backend is loaded."""

from hal.library import register
from verify_ops.copy_kv import copy_kv
from verify_ops.greedy import verify_greedy
from verify_ops.ngram import ngram_propose
from verify_ops.paged_attention import paged_attention
from verify_ops.rejection import verify_rejection
from verify_ops.sample import sample
from verify_ops.tree import verify_tree
from verify_ops.typical import verify_typical
from verify_ops.write_kv import write_kv

_ops = register("spec_hal_cpu", {
    "sample": sample, "ngram_propose": ngram_propose, "verify_greedy": verify_greedy,
    "verify_rejection": verify_rejection, "verify_typical": verify_typical, "verify_tree": verify_tree,
    "write_kv": write_kv, "paged_attention": paged_attention, "copy_kv": copy_kv})
(copy_kv, ngram_propose, paged_attention, sample, verify_greedy, verify_rejection, verify_tree, verify_typical,
 write_kv) = (_ops.copy_kv, _ops.ngram_propose, _ops.paged_attention, _ops.sample, _ops.verify_greedy,
              _ops.verify_rejection, _ops.verify_tree, _ops.verify_typical, _ops.write_kv)

__all__ = ["copy_kv", "ngram_propose", "paged_attention", "sample", "verify_greedy", "verify_rejection",
           "verify_tree", "verify_typical", "write_kv"]
