"""Every op that is a ``torch.library`` custom op (cpu: every reference op, ``spec_hal_cpu``;
cuda: every launcher, ``spec_hal_cuda``;
ascend: the verify/copy/tree-attention ops, ``spec_hal_ascend``) passes
``torch.library.opcheck``: schema and mutation annotations, fake (meta) kernel, autograd
registration and AOT dispatch with dynamic shapes. On CPU the cuda ops run under the
Triton interpreter."""

import os

import pytest
import torch

import hal
from hal.conformance.test_bad_input import valid_args
from hal.ops import OP_NAMES

ASCEND = {"verify_greedy": "verify_greedy", "verify_rejection": "verify_rejection",
          "verify_rejection_logits": "verify_rejection_logits", "verify_typical": "verify_typical",
          "verify_tree": "verify_tree", "ngram_propose": "ngram_propose", "copy_kv": "copy_kv",
          "paged_attention": "tree_attention"}


def cases():
    yield from (("cpu", op, op) for op in OP_NAMES)
    if os.environ.get("TRITON_INTERPRET") == "1":
        yield from (("cuda", op, op) for op in OP_NAMES)
    if os.environ.get("HAL_ASCEND_EMULATE") == "1":
        yield from (("ascend", op, name) for op, name in ASCEND.items())


CASES = list(cases())


@pytest.mark.skipif(not CASES, reason="needs TRITON_INTERPRET=1 and/or HAL_ASCEND_EMULATE=1")
@pytest.mark.parametrize("backend_name,op,name", CASES, ids=[f"{b}-{n}" for b, _, n in CASES])
def test_opcheck(backend_name, op, name):
    be = hal.get_backend(backend_name)   # loading the backend registers its custom ops
    args = valid_args(be, op)
    if name == "tree_attention":
        assert args["tree_mask"] is not None
    custom = getattr(getattr(torch.ops, f"spec_hal_{backend_name}"), name)
    torch.library.opcheck(custom, tuple(args.values()))


def test_every_cuda_op_is_a_custom_op():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    impl = hal.get_backend("cuda").impl
    for op in OP_NAMES:
        assert isinstance(getattr(impl, op), torch._library.custom_ops.CustomOpDef), op
