"""Compile every cuda kernel for a real GPU target, on a machine without one.

Each cuda op runs on valid conformance cases (`hal.conformance._cases.valid_case`, drawn by
hypothesis) with CPU tensors, while Triton is told its device is an ``sm_<arch>`` GPU and every
launch is a warm-up: the kernel is compiled to a cubin for the arguments' real signature and
specialization, and nothing runs. Outputs are therefore garbage and only compile failures count
(a kernel the interpreter runs but the GPU compiler refuses: plain-int globals, a failing MLIR
pass). Run it under the Triton version of the GPU image before a device check:

    python scripts/compile_check.py [--arch 90] [--examples 12] [--ops verify_tree,sample]

Exit 1 and one line per failing (op, kernel signature) when any kernel fails to compile."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, said out loud
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

OPS = ("sample", "verify_greedy", "verify_rejection", "verify_rejection_logits", "verify_typical", "verify_tree",
       "ngram_propose", "write_kv", "copy_kv", "paged_attention")
COMPILE_ERRORS = ("CompilationError", "PassManager", "Cannot access global", "ptxas")


class CompileOnly:
    """Triton's active driver for a GPU that is not there: its target, device 0, stream 0."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list[str] = []   # kernels compiled (one entry per specialization)


def compile_only(arch: int) -> None:
    driver.set_active(CompileOnly(arch))
    run, do_compile = JITFunction.run, JITFunction._do_compile
    JITFunction.run = lambda self, *a, grid, warmup, **kw: run(self, *a, grid=grid, warmup=True, **kw)

    def counted(self, *a, **kw):
        COMPILED.append(self.fn.__name__)
        return do_compile(self, *a, **kw)

    JITFunction._do_compile = counted


class Backend:
    """What `valid_case` reads of a backend: its device (host tensors: nothing runs) and the cuda
    backend's own `BackendSpec` (its KV block sizes), as its plugin registers it."""

    device_type = "cpu"

    def __init__(self):
        import backends.cuda as pkg
        specs = []
        pkg.register_backends(register=specs.append)
        self.spec = specs[0]


def check(op: str, examples: int) -> list[str]:
    from backends.cuda import ops
    from hal.conformance._cases import valid_case

    be, fn, failures = Backend(), getattr(ops, op), []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def prop(data):
        args, _ = data.draw(valid_case(be, op))
        try:
            fn(**args)
        except Exception as e:   # garbage outputs may fail the op's own host code: only compile failures count
            text = f"{type(e).__name__}: {e}"
            if any(s in text for s in COMPILE_ERRORS):
                line = next((x for x in str(e).splitlines() if "error" in x.lower()), text.splitlines()[0])
                failures.append(f"{op}: {type(e).__name__}: {line.strip()[:200]}")

    prop()
    return sorted(set(failures))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--examples", type=int, default=12, help="hypothesis cases per op")
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    compile_only(args.arch)
    failed = [f for op in args.ops.split(",") for f in check(op, args.examples)]
    print(f"triton {triton.__version__}, sm_{args.arch}, torch {torch.__version__}: {len(COMPILED)} "
          f"specializations of {len(set(COMPILED))} kernels compiled, {len(failed)} compile failure(s)")
    print("\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
