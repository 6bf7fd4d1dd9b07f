"""PageAllocator / SlotPool: allocation, refcounts, validation, integrity under random operations.

Run: `python -m pytest tests/serving/test_cache_allocator.py -q`
"""

import random

import numpy as np
import pytest

from serving.cache import IntegrityError, OutOfPages, OutOfSlots, PageAllocator, SlotPool


def test_allocate_hands_out_distinct_ids_with_refcount_one():
    pool = PageAllocator(6)
    ids = pool.allocate(4)
    assert len(set(ids)) == 4 and all(0 <= i < 6 for i in ids)
    assert all(pool.refcount(i) == 1 for i in ids)
    assert (pool.num_free, pool.num_used) == (2, 4)
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_out_of_pages_allocates_nothing():
    pool = PageAllocator(4)
    pool.allocate(3)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()
    slots = SlotPool(2)
    with pytest.raises(OutOfSlots):
        slots.allocate(3)
    assert slots.num_free == 2


def test_decref_returns_freed_ids_and_reuses_them_last():
    pool = PageAllocator(4)
    a, b, c, d = pool.allocate(4)
    pool.incref([a, a, b])
    assert pool.refcount(a) == 3
    assert pool.decref([a, b, c]) == [c]
    assert pool.decref([a, a, b]) == [a, b]
    assert pool.num_free == 3
    assert pool.allocate(3) == [c, a, b]  # FIFO: freed order
    pool.check_integrity()


def test_bad_calls_raise_value_error_and_change_nothing():
    pool = PageAllocator(4)
    (a,) = pool.allocate(1)
    for bad in (-1, 4, 1.5, True, "0", None):
        with pytest.raises(ValueError):
            pool.refcount(bad)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        pool.incref([a, 3])  # 3 is free: nothing changes, not even a
    assert pool.refcount(a) == 1
    with pytest.raises(ValueError):
        pool.decref([a, a])  # one reference only
    assert pool.refcount(a) == 1
    with pytest.raises(ValueError):
        pool.decref(7)
    with pytest.raises(ValueError):
        PageAllocator(0)
    assert pool.decref([np.int32(a)]) == [a]  # numpy ids are fine
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = SlotPool(3)
    pool.allocate(1)
    pool._free.append(pool._free[0])  # duplicate on the free list
    with pytest.raises(IntegrityError):
        pool.check_integrity()
    pool = SlotPool(3)
    (s,) = pool.allocate(1)
    pool._free.append(s)  # both free and referenced
    with pytest.raises(IntegrityError):
        pool.check_integrity()
    pool = SlotPool(3)
    pool.allocate(1)
    pool._free.pop()  # lost: neither free nor referenced
    with pytest.raises(IntegrityError):
        pool.check_integrity()


def test_random_operations_match_a_model():
    rng = random.Random(0)
    pool = PageAllocator(32)
    model: dict[int, int] = {}  # id -> refcount, referenced ids only
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(0, 8)
            if n > 32 - len(model):
                with pytest.raises(OutOfPages):
                    pool.allocate(n)
            else:
                for i in pool.allocate(n):
                    assert i not in model
                    model[i] = 1
        elif op < 0.55 and model:
            ids = rng.choices(sorted(model), k=rng.randint(1, 4))
            pool.incref(ids)
            for i in ids:
                model[i] += 1
        elif model:
            ids = rng.sample(sorted(model), k=rng.randint(1, min(4, len(model))))
            expect = [i for i in ids if model[i] == 1]
            assert pool.decref(ids) == expect
            for i in ids:
                model[i] -= 1
                if model[i] == 0:
                    del model[i]
        pool.check_integrity()
        assert pool.num_used == len(model)
        assert all(pool.refcount(i) == r for i, r in model.items())
    while model:
        i = next(iter(model))
        pool.decref([i] * model.pop(i))
    assert pool.num_free == 32
    pool.check_integrity()
