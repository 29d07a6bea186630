"""The cpu backend: the torch reference ops of `verify_ops`, vectorised over the batch.

It is the oracle of the conformance suite and a production path in its own right.
"""

from __future__ import annotations

import importlib

from hal import BackendSpec, BlockSizes, hookimpl


@hookimpl
def register_backends(register):
    register(BackendSpec(
        name="cpu",
        device_type="cpu",
        load=lambda: importlib.import_module("backends.cpu.ops"),
        priority=0,
        block_sizes=BlockSizes(lo=1, hi=1 << 16, power_of_two=True),
        head_dim_align=1,
        validation="reference: executed on CPU (the oracle)",
        always_check_values=True,
    ))
