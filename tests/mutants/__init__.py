"""Deliberately broken backends, registered through the plugin path (``HAL_PLUGINS=tests.mutants``).

Each mutant is the cpu backend with one reference op recompiled from its source
with one planted change. The conformance suite must fail on every one.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

from backends.cuda import INTERPRETED_DRAWS, INTERPRETED_FUZZ
from hal import BackendSpec, hookimpl

# name: (module, function, original text, planted text, a test that must catch it)
MUTANTS = {
    "unclamped-residual": ("verify_ops.rejection", "verify_rejection",
                           "residual = (p - q * rejected).clamp(min=0)", "residual = (p - q * rejected)",
                           "test_rejection.py"),
    "bonus-from-q": ("verify_ops.rejection", "verify_rejection",
                     "q * rejected).clamp(min=0)\n    residual = torch.where(",
                     "q * rejected).clamp(min=0)\n    residual = torch.where(~rejected, q, residual)\n"
                     "    residual = torch.where(", "test_rejection.py"),
    "accept-boundary-inverted": ("verify_ops.rejection", "verify_rejection", "(u * q_x < p_x)", "(u * q_x <= p_x)",
                                 "test_rejection.py::test_edge_rules"),
    "logits-temperature-ignored": ("verify_ops.rejection_logits", "verify_rejection_logits", ".div_(t_row[a:b, None])",
                                   "", "test_rejection_logits.py::test_exact"),
    "logits-greedy-sampled": ("verify_ops.rejection_logits", "verify_rejection_logits",
                              "torch.where(greedy[:, None], is_top[at], u * q_x < p_tok[at])", "(u * q_x < p_tok[at])",
                              "test_rejection_logits.py::test_greedy_requests"),
    "logits-greedy-tie-ignored": ("verify_ops.rejection_logits", "verify_rejection_logits",
                                  "((t == 0) | (earlier < m))", "(t >= 0)",
                                  "test_rejection_logits.py::test_greedy_requests"),
    "logits-last-row-is-first": ("verify_ops.rejection_logits", "verify_rejection_logits",
                                 "last = rows.gather(1, n_acc[:, None].long())[:, 0]", "last = rows[:, 0]",
                                 "test_rejection_logits.py::test_exact"),
    "tree-siblings-keep-residual": ("verify_ops.tree", "verify_tree",
                                    "residual = torch.where((tried & ~acc)[:, None], rest, residual)",
                                    "residual = residual", "test_tree.py::test_sampling_is_exact"),
    "write-padding-slot": ("verify_ops.write_kv", "write_kv", "keep = slot_mapping >= 0",
                           "keep = slot_mapping >= -1", "test_kv.py"),
    "causal-off-by-one": ("verify_ops.paged_attention", "paged_attention", "own = j - ctx <= i",
                          "own = j - ctx <= i + 1", "test_kv.py"),
    "greedy-tie-flipped": ("verify_ops.greedy", "verify_greedy", "top = first_max(target_logits.float())[1][rows]",
                           "top = (target_logits.shape[-1] - 1 - target_logits.float().flip(-1).argmax(-1))[rows]",
                           "test_greedy.py"),
    "ngram-latest-match": ("verify_ops.ngram", "ngram_propose", "end = (match == best[:, None]).int().argmax(-1)",
                           "end = L - 1 - (match == best[:, None]).int().flip(-1).argmax(-1)", "test_ngram.py"),
    "top-p-drops-boundary": ("verify_ops.sample", "sample", "(pv.cumsum(-1) - pv < top_p[:, None])",
                             "(pv.cumsum(-1) < top_p[:, None])", "test_sample.py"),
    "typical-entropy-sign": ("verify_ops.typical", "verify_typical", "posterior_alpha * torch.exp(-entropy)",
                             "posterior_alpha * torch.exp(entropy)", "test_typical.py"),
    "copy-kv-in-place": ("verify_ops.copy_kv", "copy_kv",
                         "k, v = k_cache[src // bs, src % bs], v_cache[src // bs, src % bs]\n"
                         "    k_cache[dst // bs, dst % bs] = k",
                         "for s_, d_ in zip(src.tolist(), dst.tolist()):\n"
                         "        k_cache[d_ // bs, d_ % bs] = k_cache[s_ // bs, s_ % bs]\n"
                         "    v = v_cache[src // bs, src % bs]", "test_kv.py"),
    # logits processors: each row must see the drafts before it
    "penalty-ignores-drafts": ("verify_ops.logits", "process_logits", "    if path.shape[1]:\n        valid = path >= 0\n        occ",
                               "    if False:\n        valid = path >= 0\n        occ",
                               "test_logits.py::test_equals_the_row_by_row_oracle"),
    "bad-words-ignore-drafts": ("verify_ops.logits", "process_logits",
                                "ctx = torch.where(m[None] < plen[:, None], from_path,",
                                "ctx = torch.where(m[None] < 0, from_path,",
                                "test_logits.py::test_equals_the_row_by_row_oracle"),
    "min-tokens-off-by-one": ("verify_ops.logits", "process_logits", "early = (plen < min_tokens",
                              "early = (plen <= min_tokens", "test_logits.py::test_equals_the_row_by_row_oracle"),
    "min-p-inverted": ("verify_ops.logits", "process_logits", "keep = out >= top + temp", "keep = out <= top + temp",
                       "test_logits.py::test_equals_the_row_by_row_oracle"),
}


CUDA_MUTANTS = {
    "cuda-causal-off-by-one": ("backends.cuda.paged_attention", "paged_attention",
                               "limit = seq if HAS_TREE else ctx + i + 1", "limit = seq if HAS_TREE else ctx + i + 2",
                               "test_kv.py"),
    "cuda-accept-boundary-inverted": ("backends.cuda.rejection", "verify_rejection", "alive = act & (u * q_x < p_x)",
                                      "alive = act & (u * q_x <= p_x)", "test_rejection.py::test_edge_rules"),
    "cuda-logits-sum-not-rescaled": ("backends.cuda.rejection_logits", "verify_rejection_logits",
                                     "s = s * tl.exp((m - safe) * inv_t) + ", "s = s + ",
                                     "test_rejection_logits.py::test_wide_vocabulary"),
    "cuda-logits-accept-boundary-inverted": ("backends.cuda.rejection_logits", "verify_rejection_logits",
                                             "x == arg.to(tl.int64), u * q_x < p_x)",
                                             "x == arg.to(tl.int64), u * q_x <= p_x)",
                                             "test_rejection_logits.py::test_edge_rules"),
    "cuda-tree-siblings-keep-residual": ("backends.cuda.tree", "verify_tree", "fresh = fresh & ~rej",
                                         "fresh = fresh", "test_tree.py::test_sampling_is_exact"),
}
CUDA_MUTANTS["cuda-ignores-strides"] = (
    "backends.cuda.write_kv", "write_kv", "torch.arange(T, device=key.device), dense(slot_mapping)",
    "torch.arange(T, device=key.device), slot_mapping", "test_fuzz.py")
ALL = {**MUTANTS, **CUDA_MUTANTS}

# Host-side mutants (not a backend): caught by tests that run them directly.
HOST_MUTANTS = {
    "non-atomic-reserve": ("hal.kv", None, "        if wanted > a.num_free:\n            raise a._exhausted(wanted)\n",
                           "", "test_kv_state.py"),
    "evicts-a-held-block": ("hal.kv", None, "        self._idle.pop(b, None)\n", "", "test_kv_state.py"),
    "grammar-ignores-drafts": ("hal.engine.grammar", "_row_paths", "return [ids[:j] for j in range(count + 1)]",
                               "return [[] for j in range(count + 1)]", "test_structured.py"),
    "grammar-special-tokens-unmasked": ("hal.engine.grammar", "Matcher",
                                        "        allowed[self.special[self.special < V]] = False\n", "",
                                        "test_structured.py"),
    "accepts-other-epochs": ("hal.distributed.remote", "RemoteDrafter", "        if reply.epoch != self.epoch:",
                             "        if False:", "test_serve.py"),
    "offered-rows-shifted": ("hal.distributed.remote", "RemoteDrafter",
                             "rows, idx = (None if t is None else t[r:r + n] for t in (msg.q, msg.idx))",
                             "rows, idx = (None if t is None else t.roll(1, 0)[r:r + n] for t in (msg.q, msg.idx))",
                             "test_generate.py"),
    "writes-a-cached-block": ("hal.kv", None, "                a.uncache(self.blocks[bi])\n", "                pass\n",
                              "test_kv_state.py"),
}


def mutate(name: str):
    """Import a copy of the mutant's module with its one change (from a file, so that
    Triton can read the kernel source); return the mutated function."""
    module, func, old, new, _ = {**ALL, **HOST_MUTANTS}[name]
    spec = importlib.util.find_spec(module)
    src = open(spec.origin).read()
    if src.count(old) != 1:
        raise AssertionError(f"mutant {name}: expected the text once in {module}, found {src.count(old)}")
    path = Path(tempfile.mkdtemp(prefix="hal-mutant-")) / f"{name.replace('-', '_')}.py"
    path.write_text(src.replace(old, new))
    mspec = importlib.util.spec_from_file_location(f"{module}__{name.replace('-', '_')}", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod if func is None else getattr(mod, func)


def _load(name: str, ops_module: str):
    ops = importlib.import_module(ops_module)
    impl = SimpleNamespace(**{n: getattr(ops, n) for n in ops.__all__})
    setattr(impl, ALL[name][1], mutate(name))
    return impl


@hookimpl
def register_backends(register):
    for name in MUTANTS:
        register(BackendSpec(name=f"mutant-{name}", device_type="cpu", load=lambda n=name: _load(n, "backends.cpu.ops"),
                             priority=-100, validation="planted bug (tests only)", always_check_values=True))
    for name in CUDA_MUTANTS:  # the cuda kernels under the Triton interpreter
        register(BackendSpec(name=f"mutant-{name}", device_type="cpu",
                             load=lambda n=name: _load(n, "backends.cuda.ops"), priority=-100,
                             probe=lambda: None if os.environ.get("TRITON_INTERPRET") == "1" else "needs TRITON_INTERPRET=1",
                             validation="planted bug (tests only)", always_check_values=True,
                             fuzz_examples=INTERPRETED_FUZZ, draw_share=INTERPRETED_DRAWS))   # caught at the interpreter's default counts
