"""Building an engine: the one layer between the entry points (CLI, server, two-rank launcher,
training data, automatic placement) and the engine.

- `flags`: the flags every target entry point shares; `spec_config`: ``--speculative-config``, vLLM's JSON form
  of ``--draft`` and ``--k``;
- `phases`: start-up as the user sees it (one line per phase, with its time);
- `build`: the linear plan, the memory plan, the target, the drafter, the grammar compiler,
  the router and the `hal.engine.SpeculativeDecoder` itself (the only place one is made);
- `start`: a rank's start-up (single process, target rank or draft rank), `Target`;
- `measure`: what ``HAL_PLACEMENT=auto`` measures;
- `generate`: ``torchrun --nproc-per-node 2 -m hal.launch --draft ... --prompt ...``."""
