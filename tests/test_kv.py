"""Host-side KV bookkeeping: allocator, sequences (append, rollback, fork, free), pools."""

import pytest
import torch

import hal
from hal.kv import BlockAllocator, Sequence, block_copy_slots, block_tables


def test_reserve_commit_rollback_reuses_slots():
    a = BlockAllocator(4, 4)
    s = Sequence(a)
    slots, copies = s.reserve(6)
    assert len(slots) == 6 and not copies and len(s.blocks) == 2
    s.commit(3)                                   # 3 kept, 3 rejected: nothing erased
    again, _ = s.reserve(2)
    assert again == slots[3:5], "rejected slots are reused by the next step"
    s.commit(2)
    assert s.length == 5 and a.num_free == 2
    s.truncate(1)
    assert s.length == 1 and len(s.blocks) == 2
    with pytest.raises(hal.HalError):
        s.commit(1)                               # nothing reserved
    with pytest.raises(hal.HalError):
        s.truncate(3)


def test_a_freed_sequences_cached_blocks_are_evicted_last_first():
    """A prefix cache hit needs a request's leading blocks: freed, they are evicted after the rest."""
    from hal.kv import block_hashes
    a = BlockAllocator(4, 2, caching=True)
    s = Sequence(a)
    s.reserve(6)
    s.commit(6)
    names = block_hashes(list(range(6)), 2)
    s.cache_full_blocks(list(range(6)))
    s.free()
    a.allocate()                                  # one eviction (one block was never used)
    a.allocate()
    assert a.evictions == 1 and len(a.match(names)) == 2


def test_fork_is_copy_on_write():
    a = BlockAllocator(6, 4)
    s = Sequence(a)
    s.reserve(6)
    s.commit(6)                                  # block 0 full, block 1 half
    child = s.fork()
    assert a.refcount[s.blocks[0]] == 2 and a.refcount[s.blocks[1]] == 2
    slots, copies = child.reserve(1)
    assert copies == [(s.blocks[1], child.blocks[1])]
    assert child.blocks[0] == s.blocks[0] and child.blocks[1] != s.blocks[1]
    assert slots == [child.blocks[1] * 4 + 2]
    src, dst = block_copy_slots(copies, 4)
    assert src.tolist() == [s.blocks[1] * 4 + i for i in range(4)]
    assert dst.tolist() == [child.blocks[1] * 4 + i for i in range(4)]
    child.free()
    s.free()
    assert a.num_free == 6 and all(r == 0 for r in a.refcount)


def test_exhaustion_is_an_error_and_leaves_state_intact():
    a = BlockAllocator(2, 4)
    s = Sequence(a)
    s.reserve(4)
    s.commit(4)
    with pytest.raises(hal.HalError, match="free block"):
        s.reserve(9)                             # needs 2 more blocks, only 1 free
    assert a.num_free == 1 and len(s.blocks) == 1
    with pytest.raises(hal.HalError, match="double free"):
        a.decref(1)


def test_block_tables_pad_with_zero():
    a = BlockAllocator(8, 2)
    seqs = [Sequence(a) for _ in range(3)]
    for n, s in zip([1, 5, 0], seqs):
        s.reserve(n)
        s.commit(n)
    bt = block_tables(seqs)
    assert bt.dtype == torch.int32 and bt.shape == (3, 3)
    assert bt[1].tolist() == seqs[1].blocks and bt[2].tolist() == [0, 0, 0]


def test_pools_are_checked_against_the_backend_before_allocating():
    be = hal.get_backend("cpu")
    pool = hal.KVPool(be, num_blocks=3, block_size=16, num_kv_heads=2, head_dim=8, num_layers=2)
    assert len(pool.k) == 2 and pool.k[0].shape == (3, 16, 2, 8)
    draft = hal.KVPool(be, num_blocks=2, block_size=16, num_kv_heads=1, head_dim=8)
    assert draft.allocator is not pool.allocator
    with pytest.raises(hal.HalError) as e:
        hal.KVPool(be, num_blocks=3, block_size=24, num_kv_heads=2, head_dim=8)
    assert e.value.arg == "block_size" and "powers of two" in str(e.value)
    spec = hal.BackendSpec(name="aligned", device_type="cpu", load=lambda: be.impl, head_dim_align=16,
                           block_sizes=hal.BlockSizes(lo=128, hi=512, multiple_of=128, power_of_two=False))
    aligned = hal.Backend(spec, be.impl)
    with pytest.raises(hal.HalError) as e:
        hal.KVPool(aligned, num_blocks=3, block_size=128, num_kv_heads=2, head_dim=72)
    assert e.value.arg == "head_dim"
    assert 384 in spec.block_sizes and 64 not in spec.block_sizes and 640 not in spec.block_sizes
