"""Random-weight Llama runners for tests (`hal.models.llama.random_llama`, shared with the benchmarks)."""

from hal.models.llama import random_llama

__all__ = ["random_llama"]
