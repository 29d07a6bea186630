PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo conformance bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: this machine's local CPU build, never a CUDA download.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,triton,models,docs]"
	touch $(STAMP)

# The suite runs in JOBS pytest-xdist workers (whole files each, so a module's server or model
# is made once), each with one intra-op thread: the cores, at most 4 (each worker holds its own
# models). The linear plan is measured (or read) once first, alone, so no worker measures it
# while another loads the machine.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

# the layer contracts (pyproject.toml), the docs site (a broken reference fails), then the suite
test: $(STAMP)
	@command -v ip >/dev/null 2>&1 || apt-get install -y -qq iproute2 >/dev/null 2>&1 || \
		echo "make test: iproute2 is missing and could not be installed; the two-namespace tests will skip"
	$(BIN)/lint-imports --no-cache
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site
	-$(BIN)/python -m hal info >/dev/null
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 HAL_ASCEND_EMULATE=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile \
		--durations=15

demo: $(STAMP)
	$(BIN)/python -m hal info
	$(BIN)/python -m hal demo

conformance: $(STAMP)
	$(BIN)/python -m hal conformance --backend $${HAL_BACKEND:-cpu}

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench,serve]"
	$(BIN)/python benchmarks/ops.py
	$(BIN)/python benchmarks/forward.py
	$(BIN)/python benchmarks/row_kernels.py
	$(BIN)/python benchmarks/q4q8.py
	$(BIN)/python benchmarks/int4_rows.py
	$(BIN)/python benchmarks/head_forms.py
	$(BIN)/python benchmarks/dtype_drift.py
	$(BIN)/python benchmarks/processors.py
	$(BIN)/python benchmarks/e2e.py --k 3 --eagle-k 4 --tree-k 7
	$(BIN)/python benchmarks/trees.py
	$(BIN)/python benchmarks/remote_head.py
	$(BIN)/python benchmarks/draft_thread.py
	$(BIN)/python benchmarks/fanout_hits.py
	@if [ "$$(id -u)" = 0 ] && command -v ip >/dev/null; then $(BIN)/python benchmarks/link_overlap.py; \
		else echo "make bench: benchmarks/link_overlap.py needs root and iproute2 (network namespaces); skipped"; fi
	$(BIN)/python benchmarks/head_heldout.py
	$(BIN)/python benchmarks/spec_ceiling.py --prompts 24 --max-new-tokens 64
	$(BIN)/python benchmarks/draft_linears.py
	$(BIN)/python benchmarks/sched.py
	cd benchmarks && ../$(BIN)/python engine.py
	cd benchmarks && ../$(BIN)/python serve.py
	$(BIN)/python benchmarks/load.py
	$(BIN)/python benchmarks/load.py --case prefix --requests 8 --max-tokens 24
	$(BIN)/python benchmarks/defaults.py
	$(BIN)/python benchmarks/structured.py
	@echo "make bench: the slow tests (HAL_SLOW=1: the long tail, the full interpreter grids, the partition-and-rejoin)"
	HAL_SLOW=1 TRITON_INTERPRET=1 HAL_ASCEND_EMULATE=1 $(BIN)/python -m pytest -q hal/conformance/test_long_tail.py \
		hal/conformance/test_sample.py hal/conformance/test_fuzz.py tests/distributed/test_netns.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
