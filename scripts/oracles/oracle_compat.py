"""What the reference scripts here patch at run time, never in the authors' files: transformers
5.25's ``DynamicCache.crop`` takes a negative count of tokens to remove and raises for n > 0,
where the authors' pinned versions (4.57.1 for z-lab/dflash, 5.10.2 for DeepSpec) kept the
first n tokens; both call ``crop(start)`` meaning that."""

from __future__ import annotations

from transformers import DynamicCache


def patch_dynamic_cache_crop() -> None:
    """``DynamicCache.crop(n)`` with n >= 0 keeps the first n tokens again (a negative n is passed on)."""
    remove = DynamicCache.crop

    def crop(self, max_length: int):
        if max_length < 0:
            return remove(self, max_length)
        excess = self.get_seq_length() - max_length
        if excess > 0:
            remove(self, -excess)

    DynamicCache.crop = crop
