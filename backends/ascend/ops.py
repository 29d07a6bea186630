"""The ascend backend's ops: the names of verify_ops/, mapped onto torch_npu."""

from backends.ascend.copy_kv import copy_kv
from backends.ascend.greedy import verify_greedy
from backends.ascend.logits import process_logits
from backends.ascend.ngram import ngram_propose
from backends.ascend.paged_attention import paged_attention
from backends.ascend.rejection import verify_rejection
from backends.ascend.rejection_logits import verify_rejection_logits
from backends.ascend.sample import sample
from backends.ascend.tree import verify_tree
from backends.ascend.typical import verify_typical
from backends.ascend.write_kv import write_kv

__all__ = ["copy_kv", "ngram_propose", "paged_attention", "process_logits", "sample", "verify_greedy", "verify_rejection",
           "verify_rejection_logits", "verify_tree", "verify_typical", "write_kv"]
