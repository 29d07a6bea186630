"""No op reads tensor values on the host (a device sync on an accelerator) when value checks
are off (``HAL_CHECK`` unset): every cuda launcher, every ascend op, and every cpu reference
op that a device backend composes. Reads are ``tolist``, ``item``, ``cpu``, ``numpy`` and
``bool``/``int``/``float``/``index`` of a tensor, counted around ``be.impl.<op>`` (the op
without its checks) on small valid inputs.

Not counted: the Triton interpreter's own launch (on a GPU that is a kernel launch), the CPU
emulation of torch_npu's kernels (on an NPU those are aclnn kernels), and the one documented
exception below. `HOST_ONLY` lists the paths that read values only when the tensors are
host tensors, where no device is involved: no device backend runs them."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import hal
from hal.conformance.test_bad_input import valid_args
from hal.ops import OP_NAMES

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# torch_npu.npu_fused_infer_attention_score takes host lists (SymInt[]) of query and KV lengths;
# vllm-ascend passes them from its host-side metadata too. Read in `_adapter.fused_infer_attention`.
ALLOWED = {("ascend", "paged_attention-causal"): 2}
HOST_ONLY = {
    ("cpu", "sample"): "sizes its partial sort from top_k/top_p (the engine passes a host-known width instead)",
    ("cpu", "paged_attention-causal"): "the causal path pads queries to the longest one (the tree path uses the mask's width)",
    ("cpu", "write_kv"): "drops -1 slots by boolean indexing",
    ("cuda", "sample"): "skips the top-k/top-p bisections when no row needs them, only where tensors are on the host "
                        "(the Triton interpreter); on a GPU they always run",
}


@contextlib.contextmanager
def counting(monkeypatch, quiet):
    """Count value reads, except inside the callables ``quiet`` lists as (object, attribute)."""
    state = {"n": 0, "depth": 0, "where": []}
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def read(self, *a, _orig=orig, _name=name, **kw):
            if state["depth"] == 0:
                state["n"] += 1
                import traceback
                state["where"].append(_name + ": " + "".join(traceback.format_stack(limit=5)[:-1]))
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, read)
    for obj, attr in quiet:
        fn = getattr(obj, attr)

        def hushed(*a, _fn=fn, **kw):
            state["depth"] += 1
            try:
                return _fn(*a, **kw)
            finally:
                state["depth"] -= 1
        monkeypatch.setattr(obj, attr, hushed)
    yield state


def _quiet(name):
    if name == "cuda":
        import triton.runtime.interpreter as interp
        return [(interp.GridExecutor, "__call__")]
    if name == "ascend":
        from backends.ascend import _emulate
        return [(_emulate, n) for n in dir(_emulate) if n.startswith("npu_")]
    return []


def cases():
    names = [v for op in OP_NAMES for v in ((op, op + "-causal") if op == "paged_attention" else (op,))]
    backends = ["cpu"] + (["cuda"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + \
        (["ascend"] if os.environ.get("HAL_ASCEND_EMULATE") == "1" else [])
    return [(b, n) for b in backends for n in names if (b, n) not in HOST_ONLY]


CASES = cases()


@pytest.mark.parametrize("backend_name,case", CASES, ids=[f"{b}-{o}" for b, o in CASES])
def test_no_value_reads_inside_ops(monkeypatch, backend_name, case):
    be = hal.get_backend(backend_name)
    op = case.split("-")[0]

    def args():
        a = valid_args(be, op)
        if case.endswith("-causal"):
            a["tree_mask"] = None
        return a
    getattr(be.impl, op)(*args().values())          # warm-up: compilation and caches are not the op's steady state
    a = args()
    with counting(monkeypatch, _quiet(backend_name)) as c:
        getattr(be.impl, op)(*a.values())
    allowed = ALLOWED.get((backend_name, case), 0)
    assert c["n"] <= allowed, f"{backend_name}.{case} read tensor values {c['n']} times:\n" + "\n".join(c["where"])


def test_a_planted_read_is_counted(monkeypatch):
    """The counter sees a read hidden inside an op (here: the cpu reference asked for its max_k)."""
    be = hal.get_backend("cpu")
    args = valid_args(be, "verify_greedy")
    with counting(monkeypatch, []) as c:
        int(args["cu_num_draft_tokens"].diff().max())
        be.impl.verify_greedy(*args.values())
    assert c["n"] == 1
