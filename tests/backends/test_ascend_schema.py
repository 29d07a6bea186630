"""The ascend adapter against the real torch-npu wheel (never installed: only read).

Every call the adapter makes is checked against the op schemas in
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (parsed with
``torch._C.parse_schema``: op name, argument names, argument types, required
arguments) and run through the wheel's own meta kernels
(``torch_npu/op_plugin/meta/_meta_registrations.py``, with small stubs) on meta
tensors to check output shapes. Planted wrong keywords and layouts must fail.
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from backends.ascend import _adapter

YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META = "torch_npu/op_plugin/meta/_meta_registrations.py"


def wheel() -> Path:
    from hal.models.cache_dir import cache_dir
    version = torch.__version__.split("+")[0]
    folder = cache_dir() / "wheels"
    found = sorted(folder.glob(f"torch_npu-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder),
                        f"torch-npu=={version}"], capture_output=True, text=True)
    found = sorted(folder.glob(f"torch_npu-{version}-*.whl"))
    if r.returncode != 0 or not found:
        pytest.skip(f"torch-npu=={version} wheel could not be fetched (offline?): {r.stderr.strip()[-300:]}")
    return found[0]


@pytest.fixture(scope="module")
def npu():
    with zipfile.ZipFile(wheel()) as z:
        yaml_text, meta_src = z.read(YAML).decode(), z.read(META).decode()
    schemas = {}
    for line in yaml_text.splitlines():
        s = line.strip()
        if s.startswith("- func:") or s.startswith("func:"):
            sig = s.split("func:", 1)[1].strip()
            if "(" not in sig:   # a bare name (an entry without a schema)
                continue
            schema = torch._C.parse_schema("npu::" + sig)
            if schema.overload_name == "":
                schemas[schema.name.split("::")[1]] = schema
    return types.SimpleNamespace(schemas=schemas, meta=load_meta(meta_src))


def load_meta(src: str) -> dict:
    """The wheel's meta kernels as plain functions: top-level defs without their
    registration decorators, run against small stubs of torch_npu's helpers."""
    stub = types.SimpleNamespace(
        ErrCode=types.SimpleNamespace(VALUE="VALUE", PARAM="PARAM", TYPE="TYPE", NOT_SUPPORT="NOT_SUPPORT"),
        ops_error=lambda *a, **k: "", get_cann_version=lambda: "8.2.RC1", get_soc_version=lambda: 220)
    ns = {"torch": torch, "math": math, "os": os, "warnings": warnings, "torch_npu": types.SimpleNamespace(),
          "Library": lambda *a, **k: None, "impl": lambda *a, **k: (lambda f: f), "has_side_effect": lambda f: None,
          **vars(stub)}
    tree = ast.parse(src)
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []
        try:
            exec(compile(ast.Module([node], []), META, "exec"), ns)
        except Exception:  # noqa: BLE001 (a helper we do not need may want more of torch_npu)
            pass
    return ns


def type_ok(t: str, v) -> bool:
    """``v`` fits schema type ``t`` (as torch prints it: Tensor, Optional[str], List[int], SymInt[]...)."""
    t = t.replace("(a!)", "").replace("(b!)", "").strip()
    if t.startswith("Optional[") or t.endswith("?"):
        if v is None:
            return True
        t = t[len("Optional["):-1] if t.startswith("Optional[") else t[:-1]
    t = {"List[int]": "int[]", "List[SymInt]": "SymInt[]"}.get(t, t)
    if t == "Tensor":
        return isinstance(v, torch.Tensor)
    if t in ("int", "SymInt"):
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "float":
        return isinstance(v, float)
    if t == "bool":
        return isinstance(v, bool)
    if t == "str":
        return isinstance(v, str)
    if t in ("int[]", "SymInt[]"):
        return isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v)
    return False


def check_call(schemas, call: _adapter.Call) -> list[str]:
    """Every problem of ``call`` against the op's schema (empty when it fits)."""
    if call.op not in schemas:
        return [f"{call.op}: no such op in torch_npu"]
    args = schemas[call.op].arguments
    positional = [a for a in args if not a.kwarg_only]
    errors = []
    if len(call.args) > len(positional):
        errors.append(f"{call.op}: {len(call.args)} positional arguments, the schema takes {len(positional)}")
    given = {a.name: v for a, v in zip(positional, call.args)}
    for name, v in call.kwargs.items():
        if name in given:
            errors.append(f"{call.op}: {name} given twice")
        given[name] = v
    by_name = {a.name: a for a in args}
    for name, v in given.items():
        if name not in by_name:
            errors.append(f"{call.op}: unknown argument {name!r}")
        elif not type_ok(str(by_name[name].type), v):
            errors.append(f"{call.op}: {name} expects {by_name[name].type}, got {type(v).__name__}")
    for a in args:
        if a.name not in given and not a.has_default_value():
            errors.append(f"{call.op}: required argument {a.name!r} missing")
    return errors


def to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def meta_run(npu, call: _adapter.Call, fn_name: str):
    fn = npu.meta[fn_name]
    return fn(*map(to_meta, call.args), **{k: to_meta(v) for k, v in call.kwargs.items()})


def calls():
    """The adapter's calls on small, realistic inputs (T=5: one prefill of 3, one verify of 2)."""
    T, Hq, Hkv, D, bs, nb = 5, 8, 2, 64, 128, 4
    q = torch.zeros(T, Hq, D, dtype=torch.float16)
    kc, vc = torch.zeros(nb, bs, Hkv, D, dtype=torch.float16), torch.zeros(nb, bs, Hkv, D, dtype=torch.float16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq, qsl = torch.tensor([3, 140]), torch.tensor([0, 3, 5])
    logits = torch.zeros(2, 100)
    return dict(
        write_kv=_adapter.scatter_pa_kv_cache(torch.zeros(T, Hkv, D, dtype=torch.float16),
                                              torch.zeros(T, Hkv, D, dtype=torch.float16), kc, vc,
                                              torch.arange(T)),
        paged_attention=_adapter.fused_infer_attention(q, kc, vc, bt, seq, qsl, D ** -0.5),
        sample=_adapter.top_k_top_p(logits, torch.tensor([0, 5], dtype=torch.int32), torch.tensor([1.0, 0.9])),
    ), (T, Hq, D)


def test_every_adapter_call_fits_its_schema(npu):
    cs, _ = calls()
    for name, call in cs.items():
        assert check_call(npu.schemas, call) == [], name
    assert {c.op for c in cs.values()} == {"npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score",
                                           "npu_top_k_top_p"}


def test_meta_kernels_give_the_shapes_we_use(npu):
    cs, (T, Hq, D) = calls()
    out, _lse = meta_run(npu, cs["paged_attention"], "npu_fused_infer_attention_score_forward")
    assert tuple(out.shape) == (T, Hq, D) and out.dtype == torch.float16
    assert tuple(meta_run(npu, cs["sample"], "npu_top_k_top_p_meta").shape) == (2, 100)
    assert meta_run(npu, cs["write_kv"], "npu_scatter_pa_kv_cache_meta") is None


def test_planted_wrong_keyword_and_type_fail(npu):
    cs, _ = calls()
    fia = cs["paged_attention"]
    typo = fia._replace(kwargs={("actual_seq_length" if k == "actual_seq_lengths" else k): v
                                for k, v in fia.kwargs.items()})
    assert any("unknown argument 'actual_seq_length'" in e for e in check_call(npu.schemas, typo))
    wrong_type = fia._replace(kwargs={**fia.kwargs, "scale": 1})
    assert any("scale expects float" in e for e in check_call(npu.schemas, wrong_type))
    kv = cs["write_kv"]
    assert check_call(npu.schemas, kv._replace(kwargs={**kv.kwargs, "cache_layout": "Norm"}))
    assert check_call(npu.schemas, kv._replace(op="npu_scatter_pa_kv"))


def test_planted_wrong_layout_fails_the_shape_check(npu):
    cs, (T, Hq, D) = calls()
    fia = cs["paged_attention"]
    bsh = fia._replace(kwargs={**fia.kwargs, "input_layout": "BSH"})
    assert "npu_fused_infer_attention_score_forward" in npu.meta
    try:
        out, _ = meta_run(npu, bsh, "npu_fused_infer_attention_score_forward")
        assert tuple(out.shape) != (T, Hq, D), "a BSH layout must not look like our TND output"
    except Exception:  # noqa: BLE001 (the meta kernel rejecting it outright is a failure too)
        pass


def test_adapter_enforces_ascend_constraints():
    import hal
    cs_args = dict(query=torch.zeros(20, 8, 64), k_cache=torch.zeros(4, 128, 2, 64), v_cache=torch.zeros(4, 128, 2, 64),
                   block_tables=torch.tensor([[0, 1]], dtype=torch.int32), seq_lens=torch.tensor([40]),
                   query_start_loc=torch.tensor([0, 20]), scale=0.125)
    with pytest.raises(hal.HalError, match="1 \\+ k <= 16"):
        _adapter.fused_infer_attention(**cs_args)          # 20 queries over 40 keys: too long a verify
    with pytest.raises(hal.HalError, match="block_size a multiple of 128"):
        _adapter.fused_infer_attention(**{**cs_args, "k_cache": torch.zeros(4, 64, 2, 64)})
    with pytest.raises(hal.HalError, match="int32"):
        _adapter.fused_infer_attention(**{**cs_args, "block_tables": torch.tensor([[0, 1]])})
    with pytest.raises(hal.HalError, match="equal to T"):
        _adapter.fused_infer_attention(**{**cs_args, "query_start_loc": torch.tensor([0, 19])})
