"""PrefixCache: chained page keys, checkpoint-aligned matching, locking, eviction order, integrity.

The last test drives the cache the way the engine will (match, lock, allocate, insert, unlock,
free) over random multi-turn sessions, against a fake device that remembers what each page and
slot holds, so a use-after-free or a wrong resume point shows up as wrong contents.

Run: `python -m pytest tests/serving/test_prefix_cache.py -q`
"""

import hashlib
import random
import struct

import numpy as np
import pytest

from serving.cache import (
    IntegrityError,
    PageAllocator,
    PrefixCache,
    PrefixHit,
    SlotPool,
    page_hash,
    prefix_hashes,
)

PS = 4  # page size of every test here


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(num_pages=16, num_slots=8, **kw):
    pages, slots = PageAllocator(num_pages), SlotPool(num_slots)
    return PrefixCache(PS, pages, slots, **kw), pages, slots


def compute(cache, tokens, session=None, checkpoint=True):
    """A request that computed all of `tokens` itself, cached them and finished. Returns its pages."""
    own = cache.pages.allocate(-(-len(tokens) // PS))
    ckpt = cache.slots.allocate(1)[0] if checkpoint else None
    cache.insert(tokens, own, ckpt, session)
    cache.pages.decref(own)
    if ckpt is not None:
        cache.slots.decref([ckpt])
    cache.check_integrity()
    return own


# ------------------------------------------------------------------------------------ hashing


def test_page_hash_known_answer():
    h1 = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 151_000)).hexdigest()
    h2 = hashlib.sha256(bytes.fromhex(h1) + struct.pack("<4I", 5, 6, 7, 2**32 - 1)).hexdigest()
    assert page_hash([1, 2, 3, 151_000], None) == h1
    assert page_hash([5, 6, 7, 2**32 - 1], h1) == h2
    assert len(h1) == 64
    tokens = [1, 2, 3, 151_000, 5, 6, 7, 2**32 - 1, 9]
    assert prefix_hashes(tokens, PS) == [h1, h2]  # full pages only
    assert prefix_hashes([1, 2, 3], PS) == [] and prefix_hashes([], PS) == []


def test_page_hash_is_deterministic_and_chained():
    page = [10, 11, 12, 13]
    assert page_hash(page, None) == page_hash(np.array(page, np.int32), None)
    assert page_hash(page, None) == page_hash(np.array(page, np.uint64), None)
    a = prefix_hashes([1, 1, 1, 1] + page, PS)
    b = prefix_hashes([2, 2, 2, 2] + page, PS)
    assert a[1] != b[1]  # same page tokens after different prefixes: different keys
    assert a[1] != page_hash(page, None)
    assert prefix_hashes([1, 1, 1, 1] + page + [0], PS) == a
    assert page_hash([1, 2], None) != page_hash([2, 1], None)
    assert page_hash([0], None) != page_hash([0, 0], None)


@pytest.mark.parametrize(
    "tokens, parent",
    [([-1], None), ([2**32], None), ([1.5], None), ([[1, 2]], None), ([], None),
     ([1], "ab"), ([1], "z" * 64), ([1], b"0" * 64)],
)
def test_page_hash_rejects_bad_input(tokens, parent):
    with pytest.raises(ValueError):
        page_hash(tokens, parent)


def test_prefix_hashes_rejects_bad_page_size():
    for ps in (0, -4, 2.0, True):
        with pytest.raises(ValueError):
            prefix_hashes([1, 2, 3], ps)


# ------------------------------------------------------------------------------------ matching


def test_match_resumes_only_at_checkpointed_pages_and_never_at_the_end():
    cache, pages, slots = make()
    t = list(range(100, 112))  # 3 full pages
    own = compute(cache, t)  # checkpoint after page 3 only
    assert cache.match([1, 2, 3, 4, 5]).num_tokens == 0
    hit = cache.match(t + [7])
    assert (hit.num_tokens, hit.pages, hit.checkpoint_slot) == (12, tuple(own), 0)
    assert hit.hashes == tuple(prefix_hashes(t, PS))
    assert cache.match(t).num_tokens == 0  # pages 1-2 walkable, but no checkpoint there
    assert cache.match(t[:9]).num_tokens == 0
    # add a checkpoint after page 1 (its pages are cached already: only the checkpoint is new)
    ckpt = slots.allocate(1)[0]
    assert tuple(cache.insert(t[:4], pages.allocate(1), ckpt)) == (0, True)
    assert cache.match(t).num_tokens == 4  # the whole prompt would leave nothing to compute
    assert cache.match(t[:5]).num_tokens == 4
    assert cache.match(t[:4]).num_tokens == 0
    hit = cache.match(t[:8] + [0, 0, 0, 0, 0])  # diverges in page 3
    assert (hit.num_tokens, hit.checkpoint_slot, hit.pages) == (4, ckpt, (own[0],))
    assert cache.match(t[:4] + [0] * 9).num_tokens == 4
    with pytest.raises(ValueError):
        cache.match([])


def test_match_is_pure():
    cache, pages, slots = make()
    compute(cache, list(range(8)))
    key = prefix_hashes(range(8), PS)[0]
    before = (pages.num_free, slots.num_free, cache.stats(), cache.entry(key).last_access)
    for _ in range(3):
        assert cache.match(list(range(9))).num_tokens == 8
    after = (pages.num_free, slots.num_free, cache.stats(), cache.entry(key).last_access)
    assert before == after


# ------------------------------------------------------------------------------------ insert


def test_insert_skips_cached_pages_and_keeps_the_first_checkpoint():
    cache, pages, slots = make()
    t = list(range(12))
    own = pages.allocate(3)
    ckpt = slots.allocate(1)[0]
    assert tuple(cache.insert(t + [99], own + pages.allocate(1), ckpt, "s")) == (3, True)
    assert [pages.refcount(p) for p in own] == [2, 2, 2] and slots.refcount(ckpt) == 2
    # a second request computed the same tokens into its own pages: nothing new is cached
    other, other_ckpt = pages.allocate(3), slots.allocate(1)[0]
    assert tuple(cache.insert(t, other, other_ckpt)) == (0, False)
    assert pages.decref(other) == other and slots.decref([other_ckpt]) == [other_ckpt]
    # a longer history extends the cached chain
    longer = t + list(range(50, 58))
    more, ckpt2 = pages.allocate(2), slots.allocate(1)[0]
    assert tuple(cache.insert(longer, own + more, ckpt2, "s")) == (2, True)
    assert cache.match(longer + [1]).num_tokens == 20
    assert cache.insert([1, 2, 3], []) == (0, False)  # no full page: nothing to do
    cache.check_integrity()


def test_insert_rejects_bad_input_and_changes_nothing():
    cache, pages, slots = make()
    t = list(range(8))
    own = compute(cache, t)
    free_slot_ckpt = slots.allocate(1)[0]
    slots.decref([free_slot_ckpt])
    held = pages.allocate(2)
    bad_calls = [
        dict(tokens=t, pages=held[:1]),  # fewer ids than full pages
        dict(tokens=[9] * 8, pages=[held[0], held[0]]),  # one id for two pages
        dict(tokens=[9] * 8, pages=[held[0], own[1]]),  # own[1] caches another page
        dict(tokens=[9] * 4, pages=[15]),  # page 15 is free
        dict(tokens=[9] * 3, pages=held, checkpoint_slot=slots.allocate(1)[0]),  # no full page
        dict(tokens=[9] * 4, pages=held, checkpoint_slot=free_slot_ckpt),  # free slot
        dict(tokens=[9] * 4, pages=held, checkpoint_slot=0),  # slot 0 checkpoints page 2 of t
        dict(tokens=[9] * 4, pages=held, session=3),
        dict(tokens=[9] * 4, pages="ab"),
    ]

    def snapshot():
        return len(cache), pages.num_free, slots.num_free, [pages.refcount(p) for p in held]

    for kw in bad_calls:
        before = snapshot()
        with pytest.raises(ValueError):
            cache.insert(**kw)
        assert snapshot() == before
        cache.check_integrity()


# ------------------------------------------------------------------------------------ locking


def test_lock_unlock_and_stale_hits():
    cache, pages, slots = make()
    t = list(range(8))
    own = compute(cache, t)
    hit = cache.match(t + [1])
    cache.lock(hit)
    assert [pages.refcount(p) for p in own] == [2, 2] and slots.refcount(hit.checkpoint_slot) == 2
    assert cache.evict(16, 8) == (0, 0)  # locked: nothing goes
    cache.unlock(hit)
    assert [pages.refcount(p) for p in own] == [1, 1] and slots.refcount(hit.checkpoint_slot) == 1
    with pytest.raises(ValueError):
        cache.unlock(hit)  # not locked any more
    cache.evict(16)
    with pytest.raises(ValueError):
        cache.lock(hit)  # evicted since the match
    with pytest.raises(ValueError):
        cache.lock(PrefixHit(4, (), None, ()))
    cache.lock(cache.match([1, 2, 3]))  # an empty hit locks nothing and counts a query
    st = cache.stats()
    assert (st["queries"], st["query_tokens"], st["hit_tokens"]) == (2, 12, 8)
    assert st["hit_rate"] == 8 / 12 and st["cached_pages"] == 0 and st["checkpoints"] == 0
    cache.check_integrity()


# ------------------------------------------------------------------------------------ eviction


def order_recorder(cache):
    order = []

    def on_evict(entry, checkpoint_only):
        # runs before freeing: the entry is still cached and the cache's references still held
        assert cache.entry(entry.hash) is entry
        if checkpoint_only:
            assert cache.slots.refcount(entry.checkpoint_slot) == 1
        else:
            assert cache.pages.refcount(entry.page) == 1 and entry.num_children == 0
        order.append((entry.tokens[0], entry.depth, checkpoint_only))

    cache.on_evict = on_evict
    return order


def test_finished_sessions_go_before_waiting_ones_and_untagged_in_between():
    clock = Clock()
    cache, pages, _ = make(clock=clock)
    order = order_recorder(cache)
    compute(cache, [1] * 4, session="waiting")
    compute(cache, [2] * 4)  # untagged
    compute(cache, [3] * 4, session="done")  # the most recently used
    cache.set_session_state("waiting", "waiting")
    cache.set_session_state("done", "finished")
    assert cache.evict(1) == (1, 1)
    assert order == [(3, 1, False)]
    cache.evict(2)
    assert [o[0] for o in order] == [3, 2, 1]
    cache.check_integrity()


def test_waiting_session_goes_stale_after_ttl():
    clock = Clock()
    cache, pages, _ = make(clock=clock, waiting_ttl_s=600)
    order = order_recorder(cache)
    compute(cache, [1] * 4)  # untagged, least recently used
    compute(cache, [2] * 4, session="old")
    compute(cache, [3] * 4, session="new")
    cache.set_session_state("old", "waiting")
    clock.t = 500
    cache.set_session_state("new", "waiting")
    cache.evict(1)
    assert [o[0] for o in order] == [1]  # both waiting sessions are fresh: untagged goes first
    clock.t = 700  # "old" waited 700 s > 600: stale, "new" only 200 s
    cache.evict(1)
    assert [o[0] for o in order] == [1, 2]
    assert cache.session_state("old") == "active"  # forgotten once stale with no entries left
    cache.set_session_state("new", "active")  # its next turn arrived
    assert cache.session_state("new") == "active"
    with pytest.raises(ValueError):
        cache.set_session_state("new", "sleeping")


def test_lru_within_a_class():
    cache, pages, _ = make()
    order = order_recorder(cache)
    for first in (1, 2, 3):
        compute(cache, [first] * 4)
    hit = cache.match([1] * 5)
    cache.lock(hit)  # touches sequence 1: now the most recent
    cache.unlock(hit)
    cache.evict(3)
    assert [o[0] for o in order] == [2, 3, 1]


def test_leaves_before_parents_and_shared_parents_last():
    cache, pages, _ = make()
    order = order_recorder(cache)
    compute(cache, [1] * 4 + [2] * 4 + [3] * 4)
    compute(cache, [1] * 4 + [2] * 4 + [4] * 4)  # shares pages 1-2
    assert len(cache) == 4
    cache.evict(3)
    assert [(o[0], o[1]) for o in order] == [(3, 3), (4, 3), (2, 2)]
    assert len(cache) == 1
    cache.check_integrity()


def test_locked_entries_are_never_evicted():
    cache, pages, slots = make()
    compute(cache, [1] * 8)
    compute(cache, [2] * 8)
    hit = cache.match([1] * 9)
    cache.lock(hit)
    assert cache.num_evictable_pages() == 2
    assert cache.evict(16, 8) == (2, 1)
    assert cache.match([1] * 9) == hit and len(cache) == 2
    cache.unlock(hit)
    assert cache.num_evictable_pages() == 2
    assert cache.evict(16, 8) == (2, 1)
    assert pages.num_free == 16 and slots.num_free == 8


def test_checkpoint_only_eviction_when_only_slots_are_short():
    cache, pages, slots = make(num_slots=3)
    order = order_recorder(cache)
    compute(cache, [1] * 4)
    compute(cache, [2] * 4)
    slots.allocate(1)  # a live request
    assert slots.num_free == 0
    assert cache.evict(0, 1) == (0, 1)
    assert order == [(1, 1, True)] and len(cache) == 2
    assert cache.match([1] * 5).num_tokens == 0  # the page is there but cannot be resumed at
    # a leaf without a checkpoint is useless on the device: it goes before one with a checkpoint
    compute(cache, [3] * 4, checkpoint=False)
    cache.evict(1)
    assert order[-1][0] == 1 and cache.match([2] * 5).num_tokens == 4
    cache.evict(1)
    assert {o[0] for o in order[1:]} == {1, 3}
    st = cache.stats()
    assert (st["evicted_checkpoints"], st["evicted_pages"]) == (1, 2)
    cache.check_integrity()


def test_evict_counts_what_it_frees_not_a_free_target():
    cache, pages, slots = make()
    for first in (1, 2, 3):
        compute(cache, [first] * 4)
    assert pages.num_free == 13
    assert cache.evict(1) == (1, 1)  # one more page, although 13 are free already
    assert cache.evict(1, 1) == (1, 1)  # the slot freed with the page counts: no checkpoint alone
    assert cache.evict(0, 0) == (0, 0) and len(cache) == 1


def test_on_evict_failure_leaves_the_entry():
    cache, pages, _ = make()
    compute(cache, [1] * 4)

    def boom(entry, checkpoint_only):
        raise RuntimeError("copy failed")

    cache.on_evict = boom
    with pytest.raises(RuntimeError):
        cache.evict(16)
    assert len(cache) == 1
    cache.check_integrity()


def test_evict_bad_input():
    cache, _, _ = make()
    for bad in ((-1,), (1, -1), (1.0,), (None,)):
        with pytest.raises(ValueError):
            cache.evict(*bad)
    assert cache.evict(0) == (0, 0)


def test_clear_keeps_locked_entries_and_frees_the_rest():
    cache, pages, slots = make()
    compute(cache, [1] * 12)
    compute(cache, [1] * 4 + [5] * 4)
    hit = cache.match([1] * 4 + [5] * 4 + [0])
    cache.lock(hit)
    assert cache.clear() == 2  # pages 2-3 of the first sequence; the locked branch stays
    assert len(cache) == 2 and cache.match([1] * 4 + [5] * 4 + [0]) == hit
    cache.unlock(hit)
    assert cache.clear() == 2 and len(cache) == 0
    assert pages.num_free == 16 and slots.num_free == 8
    assert cache.stats()["evicted_pages"] == 0  # clear is not eviction
    cache.check_integrity()


# ------------------------------------------------------------------------------------ listeners


def test_listener_sees_exactly_the_stored_and_removed_keys():
    clock = Clock()
    cache, pages, slots = make(clock=clock, waiting_ttl_s=60)
    calls = []
    cache.add_listener(lambda kind, keys: calls.append((kind, keys)))
    a, b = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [3, 1, 4, 1, 7, 7, 7]  # ragged: 2 and 1 full pages
    ha = prefix_hashes(a, PS)
    compute(cache, a, session="old")
    assert calls == [("stored", tuple(ha))]  # one call per insert, parents first
    compute(cache, b, session="new")  # its one full page is a's first: cached already, no call
    assert calls[1:] == [] and cache.keys() == ha
    hb2 = prefix_hashes(b + [8], PS)[1]
    compute(cache, b + [8], session="new")
    assert calls[1:] == [("stored", (hb2,))]
    assert cache.keys()[0] == ha[0] and set(cache.keys()) == {ha[0], ha[1], hb2}
    compute(cache, a, session="old")  # cached already (a re-tag): no call
    assert len(calls) == 2
    # session expiry: "old" waits past its TTL, so its leaf goes first although used last
    cache.set_session_state("old", "waiting")
    cache.set_session_state("new", "waiting")
    clock.t = 61
    cache.set_session_state("new", "waiting")
    assert cache.evict(1) == (1, 1) and calls[2:] == [("removed", (ha[1],))]
    assert cache.evict(0, 0) == (0, 0) and len(calls) == 3  # nothing removed: no call
    cache.evict(0, 1)  # a checkpoint-only drop keeps the key set: no call
    assert len(calls) == 3 and len(cache) == 2
    # reset: children before parents; locked pages stay and are not reported
    compute(cache, [6] * 9)
    h6 = prefix_hashes([6] * 9, PS)
    hit = cache.match([6] * 9)
    cache.lock(hit)
    n = len(calls)
    assert calls[n - 1] == ("stored", tuple(h6)) and cache.clear() == 2
    assert calls[n:] == [("removed", (hb2, ha[0]))] and cache.keys() == h6
    cache.unlock(hit)
    assert cache.clear() == 2 and calls[n + 1:] == [("removed", (h6[1], h6[0]))]
    cache.check_integrity()


def test_listener_hears_pages_removed_before_on_evict_fails():
    cache, _, _ = make()
    compute(cache, [2] * 4)
    compute(cache, [1] * 4)  # more recently used: evicted second
    seen, calls = [], []
    cache.add_listener(lambda kind, keys: calls.append((kind, keys)))

    def fail_second(entry, checkpoint_only):
        seen.append(entry.hash)
        if len(seen) == 2:
            raise RuntimeError("host tier full")

    cache.on_evict = fail_second
    with pytest.raises(RuntimeError):
        cache.evict(2)
    assert calls == [("removed", (page_hash([2] * 4, None),))] and len(cache) == 1
    cache.check_integrity()


def test_listener_registration():
    cache, _, _ = make()
    calls = []

    def listener(kind, keys):
        calls.append(kind)

    with pytest.raises(ValueError, match="callable"):
        cache.add_listener("not a function")
    cache.add_listener(listener)
    compute(cache, [5] * 5)
    cache.remove_listener(listener)
    cache.clear()
    assert calls == ["stored"]
    with pytest.raises(ValueError, match="not a listener"):
        cache.remove_listener(listener)


def test_check_integrity_catches_corruption():
    cache, pages, _ = make()
    compute(cache, [1] * 8)
    e = cache.entry(prefix_hashes([1] * 8, PS)[0])
    e.num_children = 0
    with pytest.raises(IntegrityError):
        cache.check_integrity()
    e.num_children = 1
    pages.decref([e.page])  # the cache's reference dropped behind its back
    with pytest.raises(IntegrityError):
        cache.check_integrity()


# ------------------------------------------------------------------------------------ random


class Req:
    def __init__(self, session, prompt, hit, own, live):
        self.session, self.prompt, self.hit, self.own, self.live = session, prompt, hit, own, live


def expected_hit(cache, prompt):
    """Brute force: the deepest page boundary < len(prompt), all cached, with a checkpoint."""
    hashes = prefix_hashes(prompt, PS)
    best = 0
    for i in range(1, (len(prompt) - 1) // PS + 1):
        if any(h not in cache for h in hashes[:i]):
            break
        if cache.entry(hashes[i - 1]).checkpoint_slot is not None:
            best = i
    return best * PS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sessions_against_a_fake_device(seed):
    rng = random.Random(seed)
    clock = Clock()
    pages, slots = PageAllocator(40), SlotPool(10)
    page_data: dict[int, tuple] = {}  # what the fake device holds in each page
    slot_data: dict[int, tuple] = {}  # the tokens whose state each slot holds
    evicted = []

    def on_evict(entry, checkpoint_only):
        assert cache.entry(entry.hash) is entry
        if checkpoint_only:  # the page may be in use; the checkpoint is the cache's alone
            assert slots.refcount(entry.checkpoint_slot) == 1
        else:
            assert pages.refcount(entry.page) == 1 and entry.num_children == 0
        evicted.append(entry.hash)

    cache = PrefixCache(PS, pages, slots, on_evict=on_evict, waiting_ttl_s=50, clock=clock)
    mirror: set[str] = set()  # the key set as a listener follows it

    def follow(kind, keys):
        if kind == "stored":
            assert mirror.isdisjoint(keys) and all(cache.entry(k) for k in keys)
            mirror.update(keys)
        else:
            assert mirror >= set(keys) and not any(k in cache for k in keys)
            mirror.difference_update(keys)

    cache.add_listener(follow)
    system = [rng.randrange(8) for _ in range(6)]
    history = {f"s{i}": list(system) for i in range(5)}
    active: list[Req] = []

    def ensure(n_pages, n_slots):
        short_pages, short_slots = n_pages - pages.num_free, n_slots - slots.num_free
        if short_pages > 0 or short_slots > 0:
            cache.evict(max(short_pages, 0), max(short_slots, 0))
        return pages.num_free >= n_pages and slots.num_free >= n_slots

    def start():
        session = rng.choice([s for s in history if all(r.session != s for r in active)] or [None])
        base = history[session] if session else list(system)
        prompt = base + [rng.randrange(8) for _ in range(rng.randint(1, 9))]
        hit = cache.match(prompt)
        assert hit.num_tokens == expected_hit(cache, prompt) < len(prompt)
        for i, p in enumerate(hit.pages):
            assert page_data[p] == tuple(prompt[i * PS : (i + 1) * PS])
        if hit.num_tokens:
            assert slot_data[hit.checkpoint_slot] == tuple(prompt[: hit.num_tokens])
        cache.lock(hit)
        n_own = -(-len(prompt) // PS) - hit.num_pages
        if not ensure(n_own, 1):
            cache.unlock(hit)
            return
        own, (live,) = pages.allocate(n_own), slots.allocate(1)
        for j, p in enumerate(own):
            i = hit.num_pages + j
            page_data[p] = tuple(prompt[i * PS : (i + 1) * PS])
        slot_data[live] = tuple(prompt)
        active.append(Req(session, prompt, hit, own, live))

    def finish(req, cache_it=True):
        active.remove(req)
        tokens = req.prompt + [rng.randrange(8) for _ in range(rng.randint(0, 6))]
        extra = -(-len(tokens) // PS) - req.hit.num_pages - len(req.own)
        if extra > 0:  # decode growth needs pages; without them it stops at the prompt
            if ensure(extra, 0):
                req.own += pages.allocate(extra)
            else:
                tokens = req.prompt
        all_pages = [*req.hit.pages, *req.own]
        for i, p in enumerate(all_pages[req.hit.num_pages :], start=req.hit.num_pages):
            page_data[p] = tuple(tokens[i * PS : (i + 1) * PS])
        slot_data[req.live] = tuple(tokens)
        n_full, ckpt = len(tokens) // PS, None
        if cache_it and n_full and rng.random() < 0.8:
            if len(tokens) % PS == 0:
                ckpt = req.live  # the finished request's state is exactly at the boundary
            elif ensure(0, 1):
                ckpt = slots.allocate(1)[0]
                slot_data[ckpt] = tuple(tokens[: n_full * PS])
        if cache_it:
            cache.insert(tokens, all_pages, ckpt, req.session)
        cache.unlock(req.hit)
        pages.decref(req.own)
        slots.decref([req.live] if ckpt in (None, req.live) else [req.live, ckpt])
        if req.session:
            if rng.random() < 0.7:
                history[req.session] = tokens
                cache.set_session_state(req.session, "waiting")
            else:
                history[req.session] = list(system)
                cache.set_session_state(req.session, "finished")

    def check():
        cache.check_integrity()
        assert mirror == set(cache.keys())
        page_refs: dict[int, int] = {}
        slot_refs: dict[int, int] = {}
        for key in cache.keys():  # the cache's own references, and what they hold
            e = cache.entry(key)
            page_refs[e.page] = 1
            assert page_data[e.page] == e.tokens
            if e.checkpoint_slot is not None:
                slot_refs[e.checkpoint_slot] = 1
                prefix, walk = [], e
                while walk is not None:
                    prefix[:0] = walk.tokens
                    walk = cache.entry(walk.parent) if walk.parent else None
                assert slot_data[e.checkpoint_slot] == tuple(prefix)
        for r in active:
            for p in [*r.hit.pages, *r.own]:
                page_refs[p] = page_refs.get(p, 0) + 1
            for s in [r.live] + ([r.hit.checkpoint_slot] if r.hit.num_tokens else []):
                slot_refs[s] = slot_refs.get(s, 0) + 1
        assert all(pages.refcount(p) == page_refs.get(p, 0) for p in range(pages.size))
        assert all(slots.refcount(s) == slot_refs.get(s, 0) for s in range(slots.size))

    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            start()
        elif op < 0.75 and active:
            finish(rng.choice(active))
        elif op < 0.85:
            cache.evict(rng.randint(0, pages.size), rng.randint(0, slots.size))
        elif op < 0.9:
            clock.t += rng.uniform(0, 40)
        elif op < 0.93:
            cache.clear()
        check()
    assert cache.stats()["hit_tokens"] > 0 and evicted  # the run did exercise hits and eviction
    while active:
        finish(active[0], cache_it=False)
        check()
    cache.clear()
    check()
    assert len(cache) == 0 and pages.num_free == pages.size and slots.num_free == slots.size
