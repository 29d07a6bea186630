"""spec-hal: a hardware abstraction layer for speculative decoding.

This package's own modules are the contract and platform: the op contract (`ops`), what a
plugin registers and what users get (`backend`, `hookspecs`, `registry`), argument checks,
errors, the host KV allocator, metrics and device transfers. The layers above it are
subpackages: `hal.models`, `hal.engine`, `hal.drafters`, `hal.distributed`, `hal.server`,
`hal.training` (and `hal.integrations`, `hal.conformance`), each importing only downward.

``import hal`` is cheap: it registers nothing and initialises no device. The
registry is built on the first `get_backend` / `list_backends` call.
"""

from hal.backend import Backend, BackendSpec, BlockSizes
from hal.errors import HalError
from hal.hookspecs import hookimpl
from hal.kv import BlockAllocator, KVPool, Sequence
from hal.metrics import SpecDecodeMetrics
from hal.ops import OP_NAMES, Ops
from hal.registry import get_backend, list_backends, register_plugin

__all__ = ["Backend", "BackendSpec", "BlockAllocator", "BlockSizes", "HalError", "KVPool", "OP_NAMES",
           "Ops", "Sequence", "SpecDecodeMetrics", "get_backend", "hookimpl", "list_backends",
           "register_plugin"]
