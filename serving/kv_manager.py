"""Per-request cache memory: pages, a KDA slot, a checkpoint slot, and the prefix cache around them.

Lifecycle of a request's memory (all host-side bookkeeping; device copies go through the runner):

    admit      prefix-cache match -> lock the hit's pages + checkpoint; take a slot; restore the
               checkpoint into the slot; the request starts with num_cached_tokens = hit length
    grow       pages for the tokens about to be computed (evicting cache-only pages if needed)
    checkpoint after a step whose computed length is a page multiple: copy slot -> checkpoint slot;
               the prompt's own checkpoint is published to the prefix cache at once
    release    finished (or preempted by recompute): full pages up to the checkpoint go into the prefix
               cache with the checkpoint; everything else is unlocked / freed

Invariant: a request's pages[i] holds tokens [i*ps, (i+1)*ps); shared (prefix-hit) pages are full and
never written again, because a request only writes at positions >= num_cached_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serving.cache.hashing import prefix_hashes
from serving.cache.page_allocator import OutOfPages, PageAllocator, SlotPool
from serving.cache.prefix_cache import CacheEntry, PrefixCache, PrefixHit
from serving.cache.store import CacheStore, PageBlob
from serving.request import Request
from serving.runner import ModelRunner

# pages asked of the store per request while restoring a prefix: one round trip to a shared pool per block,
# and at most one block read past the first page the store lacks
STORE_FETCH_BLOCK = 32


@dataclass
class SwappedState:
    """A swap-preempted request's device state, on the host (serving.runner.ModelRunner.read_request)."""

    num_pages: int
    arrays: dict[str, np.ndarray]
    spec_pending: list[int]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class KVManager:
    """Owns the allocators, the device prefix cache and (optionally) a lower store tier (host L2).

    With a store, every page (and checkpoint) the device cache evicts is copied there first, and
    admission extends a device hit with pages found in the store, copied back before the prefill.
    """

    def __init__(self, runner: ModelRunner, page_size: int, use_prefix_cache: bool = True,
                 store: CacheStore | None = None, session_ttl_s: float = 600.0, write_through: bool = False):
        """write_through: every prefix published to the device cache (with its checkpoint) is copied to
        the store at once, not only when evicted: a store shared by several workers then serves a
        continuation on any of them (disaggregated prefill)."""
        self.runner, self.page_size, self.use_prefix_cache = runner, page_size, use_prefix_cache
        self.store = store if use_prefix_cache else None
        self.write_through = write_through and self.store is not None
        self.written_through_pages = 0
        self.pages = PageAllocator(runner.num_pages)
        self.slots = SlotPool(runner.num_slots)
        self.prefix = PrefixCache(page_size, self.pages, self.slots, on_evict=self._offload if self.store is not None else None,
                                  waiting_ttl_s=session_ttl_s)
        self.swapped_bytes = 0  # host memory held by swap-preempted requests
        self.hit_tokens = 0  # all tiers
        self.store_hit_tokens = 0  # the part of hit_tokens that came back from the store
        self.store_tokens_by_tier: dict[str, int] = {}  # tokens restored from the store, by the tier that had them
        self.query_tokens = 0

    # --- the store tier ---------------------------------------------------------------------
    def _offload(self, entry: CacheEntry, checkpoint_only: bool) -> None:
        """Device cache eviction hook: copy the page (and its checkpoint, if any) to the store."""
        latents = self.runner.read_pages([entry.page])[:, 0]
        kda = conv = None
        if entry.checkpoint_slot is not None:
            kda, conv = self.runner.read_slot(entry.checkpoint_slot)
        self.store.put(entry.hash, PageBlob(latents=latents, kda=kda, conv=conv))

    def _restore_from_store(self, tokens, device_hit: PrefixHit, session) -> None:
        """Copies the pages that extend `device_hit` from the store back to the device cache, up to the
        deepest one with a checkpoint, so that the following `match` sees the longer hit."""
        hashes = prefix_hashes(tokens[: (len(tokens) - 1) // self.page_size * self.page_size], self.page_size)
        walk, blobs, target = [], {}, 0
        tiers_before = _tier_hits(self.store)
        entries = [self.prefix.entry(h) for h in hashes]
        absent = [i for i, entry in enumerate(entries) if entry is None]
        fetched: dict[int, PageBlob | None] = {}
        for i, entry in enumerate(entries):
            if entry is not None:
                walk.append(entry.page)
                if entry.checkpoint_slot is not None:
                    target = i + 1
                continue
            if i not in fetched:  # the next block of store pages in one request (one round trip to a pool)
                k = absent.index(i)
                block = absent[k : k + STORE_FETCH_BLOCK]
                fetched.update(zip(block, self.store.get_many([hashes[j] for j in block])))
            blob = fetched[i]
            if blob is None:
                break
            walk.append(None)
            blobs[i] = blob
            if blob.has_checkpoint:
                target = i + 1
        if target * self.page_size <= device_hit.num_tokens:
            return
        missing = [i for i in range(target) if walk[i] is None]
        need_slot = self.prefix.entry(hashes[target - 1]) is None or self.prefix.entry(hashes[target - 1]).checkpoint_slot is None
        if not self._evict(len(missing), int(need_slot)) or any(self.prefix.entry(hashes[i]) is None for i in range(target) if walk[i] is not None):
            return  # memory is short, or eviction removed part of the walk: serve the device hit only
        new_pages = self.pages.allocate(len(missing))
        for i, page in zip(missing, new_pages):
            walk[i] = page
        self._count_tiers(len(missing), tiers_before)
        self.runner.write_pages(new_pages, np.stack([blobs[i].latents for i in missing], axis=1))
        ckpt = None
        if need_slot:
            [ckpt] = self.slots.allocate(1)
            self.runner.write_slot(ckpt, blobs[target - 1].kda, blobs[target - 1].conv)
        self.prefix.insert(tokens[: target * self.page_size], walk[:target], ckpt, session=session)
        self.pages.decref(new_pages)  # the cache holds them now
        if ckpt is not None:
            self.slots.decref([ckpt])

    def _publish(self, tokens, pages: list[int], slot: int, session) -> None:
        """prefix.insert, plus the write-through copy of the pages the store lacks and the checkpoint."""
        self.prefix.insert(tokens, pages, slot, session=session)
        if not self.write_through or not pages:
            return
        hashes = prefix_hashes(tokens, self.page_size)
        have = min(self.store.contains_prefix(hashes), len(pages) - 1)  # the last page goes again, with its checkpoint
        latents = self.runner.read_pages(pages[have:])
        kda, conv = self.runner.read_slot(slot)
        for i in range(have, len(pages)):
            last = i == len(pages) - 1
            self.store.put(hashes[i], PageBlob(latents=latents[:, i - have], kda=kda if last else None,
                                               conv=conv if last else None))
        self.written_through_pages += len(pages) - have

    def _count_tiers(self, restored_pages: int, tiers_before: dict[str, int] | None) -> None:
        """Attributes restored pages to store tiers: a tiered store (host L2 in front of a shared pool)
        reports per-tier hits in stats()["hits_by_tier"]; a single store names itself with a `tier`
        attribute (default "host")."""
        after = _tier_hits(self.store)
        if tiers_before is not None and after is not None:
            diff = {tier: n - tiers_before.get(tier, 0) for tier, n in after.items() if n > tiers_before.get(tier, 0)}
            total = sum(diff.values())
            # the walk also read pages past the deepest checkpoint, which are not restored: scale to those that are
            scale = min(1.0, restored_pages / total) if total else 0.0
            for tier, pages in diff.items():
                self.store_tokens_by_tier[tier] = (self.store_tokens_by_tier.get(tier, 0)
                                                   + round(pages * scale) * self.page_size)
        elif restored_pages:
            tier = getattr(self.store, "tier", "host")
            self.store_tokens_by_tier[tier] = self.store_tokens_by_tier.get(tier, 0) + restored_pages * self.page_size

    def prefetch(self, req: Request) -> None:
        """While req waits: copy the part of its prefix that only the store has back to the device
        cache now, so the transfer overlaps the running step instead of delaying req's admission.
        (JAX dispatch is asynchronous: the host-to-device copies are queued, nothing blocks here.)"""
        if self.store is None or req.host_prefetch is not None or req.swapped is not None:
            return
        tokens = req.all_ids
        hit = self.prefix.match(tokens)
        self._restore_from_store(tokens, hit, req.session)
        after = self.prefix.match(tokens).num_tokens
        req.host_prefetch = (hit.num_tokens, after)  # admission attributes the difference to the store

    # --- admission --------------------------------------------------------------------------
    def can_admit(self) -> bool:
        return self.slots.num_free > 0 or self._evict(0, 1)

    def admit(self, req: Request) -> None:
        """Gives req a slot and restores its longest cached prefix (raises OutOfPages if no slot)."""
        if self.slots.num_free == 0 and not self._evict(0, 1):
            raise OutOfPages("no free KDA slot")
        [req.slot] = self.slots.allocate(1)
        req.pages, req.checkpoints, req.hit = [], [], None
        tokens = req.all_ids
        self.query_tokens += len(tokens)
        if self.use_prefix_cache:
            if req.session is not None:
                self.prefix.set_session_state(req.session, "active")
            hit = self.prefix.match(tokens)
            if self.store is not None:
                # the device hit before any restore: now, or when req was prefetched while waiting
                device_tokens = hit.num_tokens if req.host_prefetch is None else min(req.host_prefetch[0], hit.num_tokens)
                self._restore_from_store(tokens, hit, req.session)
                hit = self.prefix.match(tokens)
                self.store_hit_tokens += max(0, hit.num_tokens - device_tokens)
                req.host_prefetch = None
            if hit.num_tokens:
                self.prefix.lock(hit)
                req.hit = hit
                req.pages = list(hit.pages)
                self.runner.copy_slots([hit.checkpoint_slot], [req.slot])
                self.hit_tokens += hit.num_tokens
        req.num_cached_tokens = req.hit.num_tokens if req.hit else 0
        req.num_computed_tokens = req.num_cached_tokens
        # where the prompt's KDA state gets checkpointed: its last page boundary before the final token
        # (a later request with the same prompt can then resume there and compute only the tail)
        req.prompt_boundary = (req.num_tokens - 1) // self.page_size * self.page_size

    # --- growth -----------------------------------------------------------------------------
    def ensure_pages(self, req: Request, num_tokens: int) -> bool:
        """Makes req's pages cover `num_tokens` tokens; False if memory is short even after eviction."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if self.pages.num_free < need and not self._evict(need, 0):
            return False
        req.pages.extend(self.pages.allocate(need))
        return True

    def _evict(self, pages: int, slots: int) -> bool:
        if not self.use_prefix_cache:
            return self.pages.num_free >= pages and self.slots.num_free >= slots
        self.prefix.evict(max(0, pages - self.pages.num_free), max(0, slots - self.slots.num_free))
        return self.pages.num_free >= pages and self.slots.num_free >= slots

    # --- checkpoints ------------------------------------------------------------------------
    def maybe_checkpoint(self, req: Request, length: int | None = None, copy_into=None) -> None:
        """After a step: if req's computed length (or `length`) sits on a page boundary, snapshot the KDA
        state there: by default copied from req's slot; `copy_into(slot)` writes it otherwise (a boundary
        crossed inside an accepted speculative run, rebuilt from the verify step's per-position updates).

        A request keeps its fixed checkpoints (its prompt boundary and its declared cache_boundaries) and
        one rolling one at the latest other boundary reached (its slot is overwritten as it moves on).
        """
        n = req.num_computed_tokens if length is None else length
        if not self.use_prefix_cache or n == 0 or n % self.page_size:
            return
        if req.checkpoints and req.checkpoints[-1][0] == n:
            return
        fixed = lambda length: length == req.prompt_boundary or length in req.cache_boundaries  # noqa: E731
        rolling = req.checkpoints and not fixed(req.checkpoints[-1][0])
        if rolling:
            slot = req.checkpoints.pop()[1]
        elif self.slots.num_free or self._evict(0, 1):
            [slot] = self.slots.allocate(1)
        else:
            return  # memory is short: skip this checkpoint, the request still runs
        if copy_into is None:
            self.runner.copy_slots([req.slot], [slot])
        else:
            copy_into(slot)
        req.checkpoints.append((n, slot))
        if fixed(n):
            # the prompt's checkpoint (and a declared shared-prefix end) is never overwritten: publish it
            # now, so requests that share it (a burst of subagents, a retry) hit it while this one runs
            self._publish(req.ids_slice(0, n), req.pages[: n // self.page_size], slot, req.session)

    # --- release ----------------------------------------------------------------------------
    def release(self, req: Request, cache: bool = True) -> None:
        """Frees req's slot and pages; with `cache`, first publishes its checkpointed prefixes."""
        if cache and self.use_prefix_cache:
            for length, slot in sorted(req.checkpoints):
                if length > req.num_tokens:  # past a stop inside an accepted speculative run
                    continue
                n_pages = length // self.page_size
                if self.write_through and (length == req.prompt_boundary or length in req.cache_boundaries):
                    self.prefix.insert(req.all_ids[:length], req.pages[:n_pages], slot, session=req.session)  # written at publication
                else:
                    self._publish(req.all_ids[:length], req.pages[:n_pages], slot, req.session)
            if req.session is not None and req.is_finished:
                self.prefix.set_session_state(req.session, "waiting")  # its next turn will want this
        self.slots.decref([slot for _, slot in req.checkpoints] + [req.slot])
        if req.hit is not None:
            self.prefix.unlock(req.hit)
            own = req.pages[len(req.hit.pages):]
        else:
            own = req.pages
        self.pages.decref(own)
        req.pages, req.slot, req.checkpoints, req.hit = [], None, [], None
        req.spec_pending = []

    # --- swap preemption --------------------------------------------------------------------
    def swap_out(self, req: Request) -> None:
        """Parks req's state (its pages' latents, KDA/conv row, drafter state) on the host and frees its
        device memory; its checkpointed prefixes go to the prefix cache as on release."""
        req.swapped = SwappedState(num_pages=len(req.pages), arrays=self.runner.read_request(req.slot, req.pages),
                                   spec_pending=list(req.spec_pending))
        self.swapped_bytes += req.swapped.nbytes
        self.release(req, cache=True)

    def swap_in(self, req: Request) -> bool:
        """Brings a swapped request back (fresh slot and pages, state written back); False if memory is short."""
        swapped = req.swapped
        if not self._evict(swapped.num_pages, 1):
            return False
        [req.slot] = self.slots.allocate(1)
        req.pages = self.pages.allocate(swapped.num_pages)
        req.checkpoints, req.hit = [], None
        self.runner.write_request(req.slot, req.pages, swapped.arrays)
        req.spec_pending = swapped.spec_pending
        self.swapped_bytes -= swapped.nbytes
        req.swapped = None
        return True

    # --- disaggregated prefill/decode (serving.disagg.roles) -----------------------------------
    def export(self, req: Request) -> dict[str, np.ndarray]:
        """req's device state on the host (the swap-out read), for a KV transfer; req keeps its memory."""
        return self.runner.read_request(req.slot, req.pages)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """A slot and pages for `num_tokens` tokens for a request whose state will arrive by transfer;
        False (nothing taken) if memory is short even after evicting cache-only entries."""
        num_pages = -(-num_tokens // self.page_size)
        if not self._evict(num_pages, 1):
            return False
        [req.slot] = self.slots.allocate(1)
        req.pages = self.pages.allocate(num_pages)
        req.checkpoints, req.hit = [], None
        req.prompt_boundary = (req.num_prompt - 1) // self.page_size * self.page_size
        return True

    def install(self, req: Request, arrays: dict[str, np.ndarray], spec_pending: list[int]) -> None:
        """Writes a transferred state into req's reserved slot and pages (the swap-in write)."""
        arrays = dict(arrays)
        arrays["kv"] = arrays["kv"][:, : len(req.pages)]
        if "draft" in arrays:
            arrays["draft"] = arrays["draft"][:, : len(req.pages)]
        self.runner.write_request(req.slot, req.pages, arrays)
        req.spec_pending = list(spec_pending)

    def discard_swapped(self, req: Request) -> None:
        """Drops a swapped request's host copy (it was aborted while preempted)."""
        if req.swapped is not None:
            self.swapped_bytes -= req.swapped.nbytes
            req.swapped = None

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        self.slots.check_integrity()
        self.prefix.check_integrity()

    def usage(self) -> float:
        return self.pages.num_used / max(1, self.runner.num_pages)


def _tier_hits(store) -> dict[str, int] | None:
    stats = getattr(store, "stats", None)
    if stats is None:
        return None
    by_tier = stats().get("hits_by_tier")
    return dict(by_tier) if isinstance(by_tier, dict) else None


__all__ = ["KVManager", "OutOfPages", "PrefixHit"]
