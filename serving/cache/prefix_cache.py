"""Device-tier prefix cache for the hybrid model: full MLA pages by chained hash + KDA checkpoints.

Entries. One per cached full page, keyed by `hashing.page_hash` (re-exported here with
`prefix_hashes`): page id, parent hash, the page's tokens, an optional KDA checkpoint slot
(recurrent + conv state right after the page's last token), last-access tick, session tag.
Entries form a forest (parent = previous page); every entry's parent is cached.

References (counted by `PageAllocator` / `SlotPool`). The cache holds exactly one reference on each
cached page and checkpoint slot. A request using a hit holds one more on each of the hit's pages and
on its checkpoint, from `lock(hit)` to `unlock(hit)`. "Cache-only" = refcount 1.

Resuming. A hybrid model resumes only where it has both the MLA pages and the KDA state, so
`match` returns the deepest cached page *with a checkpoint*, and never the whole prompt (the engine
needs the last prompt token's logits, so at least one token is left to compute).

Request life cycle (the engine's side):
    hit = cache.match(prompt); cache.lock(hit)        # resume after hit.num_tokens, KDA state from
                                                      # hit.checkpoint_slot, MLA pages hit.pages
    own = pages.allocate(...); compute the rest; copy the KDA state at the last page end to `ckpt`
    cache.insert(tokens, [*hit.pages, *own], ckpt, session)    # the cache takes its references
    cache.unlock(hit); pages.decref(own); slots.decref([ckpt])  # the request drops its own

Eviction (`evict(more_pages, more_slots)`: how many to free, not a free-count target) frees
cache-only leaf entries (whole pages) and, when slots are still short, cache-only checkpoints alone. Order: (1) session class: finished or stale sessions, then untagged or active
ones, then sessions waiting for their next turn (a waiting session is stale after `waiting_ttl_s`);
(2) leaves without a checkpoint first (the device cannot resume at them); (3) least recently used.
`on_evict(entry, checkpoint_only)` runs before anything is freed (the engine copies the page and the
checkpoint to the host tier there); if it raises, that entry is left as it was.

Listeners (`add_listener(fn)`): fn("stored", keys) after `insert` cached new pages (parents before
children), fn("removed", keys) after `evict` or `clear` uncached pages (children before parents), so
an observer (the KV-event publisher) follows the set of cached page hashes in O(changes) without
diffing. Checkpoint-only drops and session re-tags keep the key set, so they are not reported. Each
call comes once the cache is consistent again (also when `on_evict` raises part-way through `evict`:
the pages removed before it are reported); `keys()` lists the current set to start from.

Not thread-safe: the scheduler thread owns the cache. `evict` is O(leaves + k log leaves).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from serving.cache.hashing import as_u32_tokens, check_page_size, iter_page_hashes
from serving.cache.hashing import page_hash, prefix_hashes  # noqa: F401 (re-exported)
from serving.cache.page_allocator import IntegrityError, PageAllocator, SlotPool

__all__ = ["CacheEntry", "InsertResult", "PrefixCache", "PrefixHit", "page_hash",
           "prefix_hashes"]

SESSION_STATES = ("active", "waiting", "finished")
_ACTIVE = ("active", 0.0)  # (state, since) of a session never set

# -------------------------------------------------------------------------------------- records


@dataclasses.dataclass(eq=False)
class CacheEntry:
    """One cached full page. Read-only outside PrefixCache (e.g. in `on_evict`)."""

    hash: str
    page: int
    parent: str | None
    tokens: tuple[int, ...]
    depth: int  # 1 for a sequence's first page; the page covers tokens [(depth-1)*ps, depth*ps)
    checkpoint_slot: int | None = None
    last_access: int = 0
    session: str | None = None
    num_children: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A usable prefix: the request resumes after `num_tokens` tokens, reading the MLA latents in
    `pages` and *copying* the KDA state of `checkpoint_slot` into its own slot (a checkpoint is never
    written). Empty (0 tokens, no pages, no checkpoint) when nothing is usable."""

    num_tokens: int
    pages: tuple[int, ...]
    checkpoint_slot: int | None
    hashes: tuple[str, ...]
    query_tokens: int = 0  # length of the prompt that was matched (for the hit-rate counters)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class InsertResult(NamedTuple):
    num_cached: int  # pages newly cached (the cache took a reference on each)
    checkpoint_taken: bool  # False: the cache did not reference the given checkpoint slot


# -------------------------------------------------------------------------------------- the cache


class PrefixCache:
    """The device tier over `pages` and `slots` (shared with the live requests).

    on_evict(entry, checkpoint_only): called before an entry's page (and checkpoint), or only its
        checkpoint, is freed by `evict`; not by `clear`.
    waiting_ttl_s: a session "waiting" for longer than this is evicted like a finished one.
    clock: seconds, for the TTL (injectable for tests).
    """

    def __init__(
        self,
        page_size: int,
        pages: PageAllocator,
        slots: SlotPool,
        *,
        on_evict: Callable[[CacheEntry, bool], None] | None = None,
        waiting_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        check_page_size(page_size)
        if not isinstance(pages, PageAllocator) or not isinstance(slots, SlotPool):
            raise ValueError("pages must be a PageAllocator and slots a SlotPool")
        if not waiting_ttl_s >= 0:
            raise ValueError(f"waiting_ttl_s must be >= 0, got {waiting_ttl_s!r}")
        self.page_size = page_size
        self.pages = pages
        self.slots = slots
        self.on_evict = on_evict
        self.waiting_ttl_s = waiting_ttl_s
        self._clock = clock
        self._entries: dict[str, CacheEntry] = {}
        self._by_page: dict[int, CacheEntry] = {}
        self._by_slot: dict[int, CacheEntry] = {}  # checkpoint slot -> its entry
        self._leaves: set[str] = set()  # entries with no cached children
        self._sessions: dict[str, tuple[str, float]] = {}  # session -> (state, since)
        self._session_entries: Counter[str] = Counter()
        self._tick = 0
        self._queries = self._query_tokens = self._hit_tokens = 0
        self._evicted_pages = self._evicted_checkpoints = 0
        self._listeners: list[Callable[[str, tuple[str, ...]], None]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def entry(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def keys(self) -> list[str]:
        """A snapshot of the cached page hashes, parents before children. O(cached pages)."""
        return sorted(self._entries, key=lambda h: self._entries[h].depth)

    # ------------------------------------------------------------------ change listeners

    def add_listener(self, fn: Callable[[str, tuple[str, ...]], None]) -> None:
        """Call fn("stored" | "removed", page hashes) whenever pages enter or leave the cache (see
        the module docstring). Runs on the cache owner's thread, inside insert/evict/clear: keep it
        short and do not raise (an exception reaches the caller, and later listeners miss the call)."""
        if not callable(fn):
            raise ValueError(f"a listener must be callable, got {fn!r}")
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[str, tuple[str, ...]], None]) -> None:
        """Stop calling fn; ValueError if it is not a listener."""
        try:
            self._listeners.remove(fn)
        except ValueError:
            raise ValueError(f"{fn!r} is not a listener of this cache") from None

    def _notify(self, kind: str, keys: list[str]) -> None:
        if keys:
            batch = tuple(keys)
            for fn in list(self._listeners):
                fn(kind, batch)

    # ------------------------------------------------------------------ lookup and locking

    def match(self, tokens: Sequence[int]) -> PrefixHit:
        """The deepest cached, checkpointed page boundary strictly inside `tokens`. Pure lookup."""
        arr = as_u32_tokens(tokens, allow_empty=False)
        walked: list[CacheEntry] = []
        usable = 0
        for h in iter_page_hashes(arr, self.page_size, (len(arr) - 1) // self.page_size):
            e = self._entries.get(h)
            if e is None:
                break
            walked.append(e)
            if e.checkpoint_slot is not None:
                usable = len(walked)
        hit = walked[:usable]
        return PrefixHit(
            num_tokens=usable * self.page_size,
            pages=tuple(e.page for e in hit),
            checkpoint_slot=hit[-1].checkpoint_slot if hit else None,
            hashes=tuple(e.hash for e in hit),
            query_tokens=len(arr),
        )

    def lock(self, hit: PrefixHit) -> None:
        """Take a request's references on the hit's pages and checkpoint; counts one query.

        Call right after `match`: an eviction in between can make the hit stale (ValueError)."""
        entries = self._hit_entries(hit)
        self.pages.incref(hit.pages)
        if hit.checkpoint_slot is not None:
            self.slots.incref([hit.checkpoint_slot])
        self._tick += 1
        for e in entries:
            e.last_access = self._tick
        self._queries += 1
        self._query_tokens += hit.query_tokens
        self._hit_tokens += hit.num_tokens

    def unlock(self, hit: PrefixHit) -> None:
        """Drop the references `lock(hit)` took. Frees nothing (the cache still holds each)."""
        self._hit_entries(hit)
        held = [self.pages.refcount(p) for p in hit.pages]
        if hit.checkpoint_slot is not None:
            held.append(self.slots.refcount(hit.checkpoint_slot))
        if any(r < 2 for r in held):
            raise ValueError("unlock of a hit that is not locked")
        freed = self.pages.decref(hit.pages)
        if hit.checkpoint_slot is not None:
            freed += self.slots.decref([hit.checkpoint_slot])
        assert not freed, f"unlock freed ids still cached: {freed}"

    def _hit_entries(self, hit: PrefixHit) -> list[CacheEntry]:
        if not isinstance(hit, PrefixHit):
            raise ValueError(f"expected a PrefixHit, got {type(hit).__name__}")
        if len(hit.pages) != len(hit.hashes) or hit.num_tokens != len(hit.pages) * self.page_size:
            raise ValueError("malformed PrefixHit")
        entries, parent = [], None
        for h, p in zip(hit.hashes, hit.pages):
            e = self._entries.get(h)
            if e is None or e.page != p or e.parent != parent:
                raise ValueError(f"stale PrefixHit: page {p} is no longer cached under {h[:12]}")
            entries.append(e)
            parent = h
        ckpt = entries[-1].checkpoint_slot if entries else None
        if hit.checkpoint_slot != ckpt:
            raise ValueError(f"stale PrefixHit: checkpoint {hit.checkpoint_slot}, cached {ckpt}")
        return entries

    # ------------------------------------------------------------------ insertion

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        checkpoint_slot: int | None = None,
        session: str | None = None,
    ) -> InsertResult:
        """Cache the full pages of `tokens`; pages[i] holds tokens[i*ps:(i+1)*ps].

        Pages whose hash is cached already are skipped (the caller keeps, and later frees, its own
        copy) and re-tagged with `session` if given. `checkpoint_slot`, if given, is the KDA state
        right after the last full page; it is taken (one reference) only if that page has no
        checkpoint yet. It must never be written again (a copy, or the live slot of a finished
        request). The caller keeps its own references on everything it passed. Validates everything
        before changing anything.
        """
        arr = as_u32_tokens(tokens, allow_empty=True)
        ps = self.page_size
        n_full = len(arr) // ps
        if isinstance(pages, (str, bytes)) or not isinstance(pages, Iterable):
            raise ValueError(f"pages must be a sequence of page ids, got {pages!r}")
        pages = [self.pages.check_id(p) for p in pages][:n_full]
        if len(pages) < n_full:
            raise ValueError(f"{n_full} full pages of tokens but only {len(pages)} page ids")
        if len(set(pages)) != len(pages):
            raise ValueError("the same page id is given for two pages")
        if session is not None and not isinstance(session, str):
            raise ValueError(f"session must be a str or None, got {session!r}")
        hashes = list(iter_page_hashes(arr, ps, n_full))
        for h, p in zip(hashes, pages):
            if self.pages.refcount(p) < 1:
                raise ValueError(f"page {p} is free; the caller must hold the pages it inserts")
            if h not in self._entries and p in self._by_page:
                raise ValueError(f"page {p} already holds another cached page")
        if checkpoint_slot is not None:
            checkpoint_slot = self.slots.check_id(checkpoint_slot)
            if n_full == 0:
                raise ValueError("a checkpoint needs at least one full page of tokens")
            if self.slots.refcount(checkpoint_slot) < 1:
                raise ValueError(f"slot {checkpoint_slot} is free; the caller must hold it")
            owner = self._by_slot.get(checkpoint_slot)
            if owner is not None and owner.hash != hashes[-1]:
                raise ValueError(f"slot {checkpoint_slot} is the checkpoint of another page")

        self._tick += 1
        parent, stored = None, []
        for i, (h, p) in enumerate(zip(hashes, pages)):
            e = self._entries.get(h)
            if e is None:
                page_tokens = tuple(arr[i * ps : (i + 1) * ps].tolist())
                e = CacheEntry(h, p, parent, page_tokens, depth=i + 1, session=session)
                self._add(e)
                self.pages.incref([p])
                stored.append(h)
            elif session is not None and e.session != session:
                self._retag(e, session)
            e.last_access = self._tick
            parent = h
        taken = False
        if checkpoint_slot is not None:
            last = self._entries[hashes[-1]]
            if last.checkpoint_slot is None:
                last.checkpoint_slot = checkpoint_slot
                self._by_slot[checkpoint_slot] = last
                self.slots.incref([checkpoint_slot])
                taken = True
        self._notify("stored", stored)
        return InsertResult(len(stored), taken)

    def _add(self, e: CacheEntry) -> None:
        self._entries[e.hash] = e
        self._by_page[e.page] = e
        self._leaves.add(e.hash)
        if e.parent is not None:
            parent = self._entries[e.parent]
            parent.num_children += 1
            self._leaves.discard(parent.hash)
        if e.session is not None:
            self._session_entries[e.session] += 1

    def _retag(self, e: CacheEntry, session: str) -> None:
        old, e.session = e.session, session
        self._session_entries[session] += 1
        if old is not None:
            self._session_entries[old] -= 1
            self._prune_session(old)

    # ------------------------------------------------------------------ sessions

    def set_session_state(self, session: str, state: str) -> None:
        """State: "active" (the default), "waiting" (for its next turn; stale after
        `waiting_ttl_s`) or "finished". Tags persist while the session has entries; a finished or
        stale session without entries is forgotten (back to "active") at the next `evict`."""
        if not isinstance(session, str):
            raise ValueError(f"session must be a str, got {session!r}")
        if state not in SESSION_STATES:
            raise ValueError(f"session state must be one of {SESSION_STATES}, got {state!r}")
        self._sessions[session] = (state, self._clock())

    def session_state(self, session: str) -> str:
        return self._sessions.get(session, _ACTIVE)[0]

    def _session_class(self, session: str | None, now: float) -> int:
        """0: finished or stale, 1: untagged or active, 2: waiting for its next turn."""
        state, since = self._sessions.get(session, _ACTIVE) if session is not None else _ACTIVE
        if state == "finished" or (state == "waiting" and now - since > self.waiting_ttl_s):
            return 0
        return 2 if state == "waiting" else 1

    def _prune_session(self, session: str) -> None:
        if self._session_entries[session] <= 0:
            self._session_entries.pop(session, None)
            if session in self._sessions and self._session_class(session, self._clock()) == 0:
                del self._sessions[session]

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages_needed: int, num_slots_needed: int = 0) -> tuple[int, int]:
        """Free at least `num_pages_needed` more pages and `num_slots_needed` more slots (the
        shortfall, as in SGLang: `evict(need - pages.num_free)`), or as many as are evictable.

        Returns (pages freed, slots freed); slots freed with their pages count towards the slots.
        Never raises for lack of evictable entries (check num_free after); evicting 0 is a no-op."""
        for n in (num_pages_needed, num_slots_needed):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"evict needs non-negative ints, got {n!r}")
        now = self._clock()
        pages_freed = slots_freed = 0
        if num_pages_needed > 0:
            heap = [self._evict_key(self._entries[h], now) for h in self._leaves]
            heap = [k for k in heap if self.pages.refcount(k[-1].page) == 1]
            heapq.heapify(heap)
            removed: list[str] = []
            try:
                while heap and pages_freed < num_pages_needed:
                    e = heapq.heappop(heap)[-1]
                    if self.on_evict is not None:
                        self.on_evict(e, False)
                    self._evicted_checkpoints += e.checkpoint_slot is not None
                    parent, freed_slot = self._remove(e)
                    removed.append(e.hash)
                    self._evicted_pages += 1
                    pages_freed += 1
                    slots_freed += freed_slot
                    if parent is not None and parent.num_children == 0:
                        if self.pages.refcount(parent.page) == 1:
                            heapq.heappush(heap, self._evict_key(parent, now))
            finally:  # an on_evict that raises leaves the pages removed so far removed: report them
                self._notify("removed", removed)
        if slots_freed < num_slots_needed:
            cands = [e for s, e in self._by_slot.items() if self.slots.refcount(s) == 1]
            for key in sorted(self._evict_key(e, now) for e in cands):
                if slots_freed >= num_slots_needed:
                    break
                e = key[-1]
                if self.on_evict is not None:
                    self.on_evict(e, True)
                slots_freed += self._drop_checkpoint(e)
                self._evicted_checkpoints += 1
        for session in [s for s in self._sessions if s not in self._session_entries]:
            self._prune_session(session)
        return pages_freed, slots_freed

    def _evict_key(self, e: CacheEntry, now: float) -> tuple:
        has_ckpt = e.checkpoint_slot is not None
        # the hash is unique, so tuples never compare the entries themselves
        return (self._session_class(e.session, now), has_ckpt, e.last_access, e.hash, e)

    def _remove(self, e: CacheEntry) -> tuple[CacheEntry | None, int]:
        """Uncache leaf `e` and drop the cache's references. Returns (its parent, slots freed)."""
        assert e.num_children == 0 and self._entries.get(e.hash) is e
        freed_slots = self._drop_checkpoint(e)
        del self._entries[e.hash]
        del self._by_page[e.page]
        self._leaves.discard(e.hash)
        if e.session is not None:
            self._session_entries[e.session] -= 1
            self._prune_session(e.session)
        parent = None
        if e.parent is not None:
            parent = self._entries[e.parent]
            parent.num_children -= 1
            if parent.num_children == 0:
                self._leaves.add(parent.hash)
        self.pages.decref([e.page])
        return parent, freed_slots

    def _drop_checkpoint(self, e: CacheEntry) -> int:
        if e.checkpoint_slot is None:
            return 0
        slot, e.checkpoint_slot = e.checkpoint_slot, None
        del self._by_slot[slot]
        return len(self.slots.decref([slot]))

    def clear(self) -> int:
        """reset_prefix_cache: drop every cache-only entry and checkpoint (no `on_evict`).
        Locked entries (and their ancestors) stay. Returns the number of pages uncached."""
        for slot, e in list(self._by_slot.items()):
            if self.slots.refcount(slot) == 1:
                self._drop_checkpoint(e)
        stack = [self._entries[h] for h in self._leaves]
        removed: list[str] = []
        while stack:
            e = stack.pop()
            if self.pages.refcount(e.page) != 1:
                continue
            parent, _ = self._remove(e)
            removed.append(e.hash)
            if parent is not None and parent.num_children == 0:
                stack.append(parent)
        self._notify("removed", removed)
        return len(removed)

    def num_evictable_pages(self) -> int:
        """Pages that `evict` could free now (cache-only, no locked descendant). O(entries)."""
        blocked: set[str] = set()
        count = 0
        for e in sorted(self._entries.values(), key=lambda e: e.depth, reverse=True):
            if e.hash in blocked or self.pages.refcount(e.page) > 1:
                if e.parent is not None:
                    blocked.add(e.parent)
            else:
                count += 1
        return count

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, int | float]:
        """Counters for metrics. Queries are `lock` calls (one per admitted request), in tokens;
        evictions count `evict` only (not `clear`), checkpoints alone or with their page."""
        return {
            "cached_pages": len(self._entries),
            "checkpoints": len(self._by_slot),
            "queries": self._queries,
            "query_tokens": self._query_tokens,
            "hit_tokens": self._hit_tokens,
            "hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            "evicted_pages": self._evicted_pages,
            "evicted_checkpoints": self._evicted_checkpoints,
        }

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if any invariant of the module docstring is broken (also checks
        both pools). Rehashes every entry: O(cached tokens); meant for tests and idle time."""
        self.pages.check_integrity()
        self.slots.check_integrity()

        def fail(msg: str) -> None:
            raise IntegrityError(f"prefix cache: {msg}")

        children: Counter[str] = Counter()
        for h, e in self._entries.items():
            if e.hash != h or len(e.tokens) != self.page_size:
                fail(f"entry {h[:12]} mis-keyed or not a full page")
            if page_hash(e.tokens, e.parent) != h:
                fail(f"entry {h[:12]} hash does not match its tokens and parent")
            if self.pages.refcount(e.page) < 1 or self._by_page.get(e.page) is not e:
                fail(f"entry {h[:12]} page {e.page} is free or shared with another entry")
            if e.parent is None:
                if e.depth != 1:
                    fail(f"root entry {h[:12]} at depth {e.depth}")
            elif e.parent not in self._entries or self._entries[e.parent].depth != e.depth - 1:
                fail(f"entry {h[:12]} has an uncached or misplaced parent")
            else:
                children[e.parent] += 1
            slot = e.checkpoint_slot
            held = slot is None or (self.slots.refcount(slot) >= 1 and self._by_slot.get(slot) is e)
            if not held:
                fail(f"entry {h[:12]} checkpoint slot {slot} is free or shared")
        for h, e in self._entries.items():
            if e.num_children != children[h] or (h in self._leaves) != (e.num_children == 0):
                fail(f"entry {h[:12]} children count {e.num_children} != {children[h]} or leaf set")
        if len(self._by_page) != len(self._entries) or not self._leaves <= self._entries.keys():
            fail("page index or leaf set out of step with the entries")
        if len(self._by_slot) != sum(e.checkpoint_slot is not None for e in self._entries.values()):
            fail("checkpoint index out of step with the entries")
        tags = Counter(e.session for e in self._entries.values() if e.session is not None)
        if tags != self._session_entries:
            fail("session entry counts out of step with the entries")

