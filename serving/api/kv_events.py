"""KV-cache events for the gateway's cache-aware routing (SubscribeKvEvents, smg.grpc.common).

The worker's device prefix cache is a forest of full pages keyed by chained SHA-256 page hashes
(serving.cache.hashing). The publisher listens to the cache (`PrefixCache.add_listener`) and nets
the pages stored and removed since its last batch; after an engine step with changes it publishes one
`KvEventBatch`:
- `KvBlocksStored` per chain of new pages (parents before children; `parent_block_hash` links a
  chain to its cached parent), each block with its page's token ids and `block_size` = page size;
- `KvBlocksRemoved` for pages that left the cache (eviction, reset); `KvCacheCleared` when it emptied.
`block_hash` is the first 8 bytes of the page's SHA-256 as a signed int64: equal on every worker for
equal prefixes, as the chained hash is. SMG recomputes its own content hash from `token_ids` and uses
`block_hash` only to link and remove blocks.

Sequence numbers start at 1 and grow by one per published batch. A subscriber starting at sequence s
gets the retained history after s if it reaches back that far, else a snapshot (one batch numbered with
the current sequence: Cleared, then every cached page); then live batches. Each batch carries the
engine's load (EngineLoad). The engine thread publishes; subscribers live on asyncio loops.

Netting keeps the batches what a diff of the cached set against the reported one would give: a page
stored and removed again between two batches is not reported, one removed and stored again (same hash,
so the same tokens and parent) neither. The publisher attaches to the engine's cache at its first step
(starting from `PrefixCache.keys()`), and re-attaches if the engine's cache object changes. Cost:
O(pages changed) per batch, not O(cached pages).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

from smg_grpc_proto.generated import common_pb2

HISTORY_BATCHES = 4096
SUBSCRIBER_BACKLOG = 4096  # a subscriber this far behind is dropped (it reconnects and replays)
HEARTBEAT_S = 2.0


def block_hash(page_hash_hex: str) -> int:
    """The int64 block id of a page: its SHA-256's first 8 bytes, big-endian, signed."""
    return int.from_bytes(bytes.fromhex(page_hash_hex)[:8], "big", signed=True)


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending = 0  # batches handed to the loop, not yet taken (engine-thread estimate)
        self.dropped = False

    def put(self, batch) -> None:
        if self.dropped:
            return
        self.pending += 1
        if self.pending > SUBSCRIBER_BACKLOG:
            self.dropped = True
            batch = None  # ends the stream; the subscriber resumes from its last sequence number
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, batch)
        except RuntimeError:
            self.dropped = True


class KvEventPublisher:
    def __init__(self, page_size: int, *, min_interval_s: float = 0.01, history: int = HISTORY_BATCHES,
                 in_hand: Callable[[], tuple[int, int]] | None = None):
        """in_hand: () -> (requests in flight, prompt tokens of those with no output yet), callable from any
        thread (AsyncEngine.prefill_in_hand). Heartbeats then report the prefill in hand as of the beat: the
        load record taken at the last engine step predates a request that arrived during a long step (a
        compile, a big prefill chunk), and a gateway reading a stale `prefill_pending_tokens` of 0 has nothing
        to stretch its silence bound with."""
        self.page_size = page_size
        self._in_hand = in_hand
        self.min_interval_s = min_interval_s
        self._known: dict[str, tuple[str | None, tuple[int, ...], int]] = {}  # hash -> (parent, tokens, depth)
        # the cache listened to, and its changes since the last batch (engine thread only). Invariant:
        # cached pages == known + stored - removed, with stored disjoint from known, removed within it
        self._cache = None
        self._pending_stored: dict[str, tuple[str | None, tuple[int, ...], int]] = {}
        self._pending_removed: dict[str, None] = {}  # an ordered set
        self._seq = 0
        self._history: deque = deque(maxlen=history)
        self._subscribers: set[_Subscriber] = set()
        self._lock = threading.Lock()
        self._last_diff = 0.0
        self._load = common_pb2.EngineLoad()
        self._load_time = 0.0
        self._last_output = time.monotonic()  # when the engine last emitted anything (engine thread writes)
        self.num_events = 0

    @property
    def sequence_number(self) -> int:
        return self._seq

    # --- engine thread -----------------------------------------------------------------------
    def on_step(self, engine, outputs) -> None:
        """AsyncEngine step hook: publish what changed in the device prefix cache."""
        now = time.monotonic()
        if outputs:
            self._last_output = now
        cache = _prefix_cache(engine)
        if cache is not self._cache:
            self._attach(cache)
        # throttled only while requests run: the step that finishes the last one must be reported now,
        # as the engine thread then sleeps until the next command
        if outputs and engine.requests and now - self._last_diff < self.min_interval_s:
            return
        self._last_diff = now
        known = self._known
        added, removed = self._pending_stored, list(self._pending_removed)
        if not added and not removed:
            if now - self._load_time > HEARTBEAT_S / 2:
                self._load, self._load_time = _engine_load(engine, self._in_hand), now
            return
        load = _engine_load(engine, self._in_hand)
        self._load_time = now
        with self._lock:  # `_known` and the sequence change together, as a snapshot reads them
            events = []
            if removed:
                if cache is None or len(cache) == 0:
                    events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
                else:
                    events.append(common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(
                        block_hashes=[block_hash(h) for h in removed], tier=common_pb2.KV_CACHE_TIER_DEVICE)))
                for h in removed:
                    del known[h]
            known.update(added)
            events.extend(self._stored_events(added))
            self._pending_stored, self._pending_removed = {}, {}
            self._seq += 1
            batch = common_pb2.KvEventBatch(sequence_number=self._seq, timestamp=time.time(), events=events,
                                            load=load)
            for i, ev in enumerate(batch.events):
                ev.event_id = self.num_events + i + 1
            self.num_events += len(batch.events)
            self._history.append(batch)
            self._load = load
            subscribers = list(self._subscribers)
        for sub in subscribers:
            sub.put(batch)

    def _attach(self, cache) -> None:
        """Listen to `cache` (None: no prefix cache, so nothing is cached) instead of the previous one;
        the pending changes become the difference between what it holds and what was reported."""
        if self._cache is not None:
            self._cache.remove_listener(self._on_cache_change)
        self._cache = cache
        current = cache.keys() if cache is not None else []
        current_set = set(current)
        self._pending_removed = {h: None for h in self._known if h not in current_set}
        self._pending_stored = {}
        self._on_cache_change("stored", tuple(h for h in current if h not in self._known))
        if cache is not None:
            cache.add_listener(self._on_cache_change)

    def _on_cache_change(self, kind: str, keys: tuple[str, ...]) -> None:
        """PrefixCache listener (engine thread): net the change into the pending stored/removed sets."""
        if kind == "stored":
            for h in keys:
                if h in self._pending_removed:  # reported, removed, now back (same hash, same page): no change
                    del self._pending_removed[h]
                    continue
                e = self._cache.entry(h)
                self._pending_stored[h] = (e.parent, tuple(e.tokens), e.depth)
        elif kind == "removed":
            for h in keys:
                if self._pending_stored.pop(h, None) is None:  # not stored since the last batch: it was reported
                    self._pending_removed[h] = None

    def _stored_events(self, pages: dict[str, tuple[str | None, tuple[int, ...], int]]) -> list:
        """One KvBlocksStored per chain of pages (by depth, so parents come first)."""
        events, chain, chain_parent, last = [], [], None, None
        for h, (parent, tokens, _depth) in sorted(pages.items(), key=lambda kv: kv[1][2]):
            if chain and parent == last:
                chain.append((h, tokens))
            else:
                if chain:
                    events.append(self._stored(chain, chain_parent))
                chain, chain_parent = [(h, tokens)], parent
            last = h
        if chain:
            events.append(self._stored(chain, chain_parent))
        return events

    def _stored(self, chain, parent: str | None):
        stored = common_pb2.KvBlocksStored(
            blocks=[common_pb2.KvBlock(block_hash=block_hash(h), token_ids=list(tokens), block_size=self.page_size)
                    for h, tokens in chain],
            tier=common_pb2.KV_CACHE_TIER_DEVICE, medium="GPU", locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
        if parent is not None:
            stored.parent_block_hash = block_hash(parent)
        return common_pb2.KvCacheEvent(stored=stored)

    # --- subscribers (any asyncio loop) ------------------------------------------------------
    async def subscribe(self, start_sequence_number: int = 0):
        """Async iterator of KvEventBatch: history after `start_sequence_number` or a snapshot, then live
        batches, with a load-only heartbeat while nothing changes."""
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            oldest = self._history[0].sequence_number if self._history else self._seq + 1
            if 0 < start_sequence_number <= self._seq and start_sequence_number + 1 >= oldest:
                backlog = [b for b in self._history if b.sequence_number > start_sequence_number]
            else:
                backlog = [self._snapshot()]
            self._subscribers.add(sub)
        last = backlog[-1].sequence_number if backlog else self._seq
        try:
            for batch in backlog:
                yield batch
            while True:
                try:
                    batch = await asyncio.wait_for(sub.queue.get(), timeout=HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield common_pb2.KvEventBatch(sequence_number=last, timestamp=time.time(),
                                                  load=self._heartbeat_load())
                    continue
                sub.pending -= 1
                if batch is None:  # dropped for falling behind
                    return
                if batch.sequence_number <= last:
                    continue
                last = batch.sequence_number
                yield batch
        finally:
            with self._lock:
                self._subscribers.discard(sub)

    def _heartbeat_load(self):
        load = common_pb2.EngineLoad()
        load.CopyFrom(self._load)
        load.load_only = True
        if self._in_hand is not None:
            live, pending = self._in_hand()
            load.prefill_pending_tokens = min(pending, 2**32 - 1)
            busy = live > 0
        else:
            busy = load.running_requests or load.waiting_requests
        if busy:
            # a gateway that hears nothing for a while vetoes the worker; this tells it the engine itself has
            # been quiet that long, and `prefill_pending_tokens` how much prefill can explain the quiet
            load.engine_silence_ms = int(min(time.monotonic() - self._last_output, 4e6) * 1e3)
        return load

    def _snapshot(self):
        """The whole cached state as one batch (under the lock)."""
        events = [common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())]
        events.extend(self._stored_events(self._known))
        return common_pb2.KvEventBatch(sequence_number=self._seq, timestamp=time.time(), events=events, load=self._load)


def _prefix_cache(engine):
    """The engine's device PrefixCache, or None when it runs without one."""
    kv = engine.kv
    return kv.prefix if getattr(kv, "use_prefix_cache", False) else None


def _engine_load(engine, in_hand=None):
    stats = engine.stats()
    # prompt tokens of requests that have produced nothing yet: the prefill work that explains a silence. One
    # definition with the heartbeats' where the publisher has `in_hand` (the server's); else the engine's requests
    if in_hand is not None:
        pending = in_hand()[1]
    else:
        pending = sum(r.num_prompt for r in list(engine.requests.values()) if not r.is_finished and r.num_output == 0)
    return common_pb2.EngineLoad(running_requests=stats.get("running", 0), waiting_requests=stats.get("waiting", 0),
                                 token_usage=float(stats.get("kv_usage", 0.0)),
                                 max_running_requests=engine.ecfg.max_running,
                                 engine_reports_steps=False,  # our stream carries token batches only
                                 prefill_pending_tokens=min(pending, 2**32 - 1))


__all__ = ["KvEventPublisher", "block_hash"]
