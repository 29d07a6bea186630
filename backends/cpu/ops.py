"""The cpu backend's ops: the reference implementations (one file per op in verify_ops/),
each registered as a ``torch.library`` custom op (``spec_hal_cpu::<op>``, `hal.library`),
so a decode step over them compiles with ``torch.compile(fullgraph=True)``. Registered
once, when the backend is loaded."""

from hal.library import register_module
from verify_ops.copy_kv import copy_kv
from verify_ops.greedy import verify_greedy
from verify_ops.logits import process_logits
from verify_ops.ngram import ngram_propose
from verify_ops.paged_attention import paged_attention
from verify_ops.rejection import verify_rejection
from verify_ops.rejection_logits import verify_rejection_logits
from verify_ops.sample import sample
from verify_ops.tree import verify_tree
from verify_ops.typical import verify_typical
from verify_ops.write_kv import write_kv

register_module("spec_hal_cpu", globals())   # each op imported above becomes spec_hal_cpu::<op>

__all__ = ["copy_kv", "ngram_propose", "paged_attention", "process_logits", "sample", "verify_greedy", "verify_rejection",
           "verify_rejection_logits", "verify_tree", "verify_typical", "write_kv"]
