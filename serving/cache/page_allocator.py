"""Reference-counted id pools: MLA latent pages (`PageAllocator`) and KDA state slots (`SlotPool`).

Contract (both pools are the same `RefCountedPool`):
- Ids are 0..size-1; each is free (refcount 0, on the free list) or referenced (refcount >= 1).
- `allocate(n)` hands out n free ids with refcount 1, or raises `OutOfPages` / `OutOfSlots` and
  changes nothing (never a partial allocation).
- `incref(ids)` / `decref(ids)` apply to referenced ids only; an id may repeat (counted each time).
  Both validate every id before changing any count, so a bad call changes nothing.
- `decref` returns the ids whose count reached 0; they are back on the free list already.
- Freed ids are reused first-in first-out, so a use-after-free shows up late rather than never.

Who holds references: a live request on each page/slot it reads or writes, the prefix cache on each
cached page and KDA checkpoint slot. The pools know nothing about who; they only count.
A slot holds either a live request's recurrent + conv state or a KDA checkpoint (a copy of both).
"""

from __future__ import annotations

import operator
from collections import Counter, deque
from collections.abc import Iterable


class IntegrityError(RuntimeError):
    """A cache structure's internal invariant does not hold (raised by `check_integrity`)."""


class OutOfResources(RuntimeError):
    """Fewer free ids than asked for; nothing was allocated."""


class OutOfPages(OutOfResources):
    """The page pool has fewer free pages than asked for."""


class OutOfSlots(OutOfResources):
    """The slot pool has fewer free slots than asked for."""


class RefCountedPool:
    """A fixed set of integer ids with reference counts and a FIFO free list."""

    kind = "id"
    out_of_capacity: type[OutOfResources] = OutOfResources

    def __init__(self, size: int):
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{type(self).__name__} size must be a positive int, got {size!r}")
        self.size = size
        self._refs = [0] * size
        self._free: deque[int] = deque(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n free ids with refcount 1; if fewer are free, raises `out_of_capacity` (no change)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"allocate needs a non-negative int, got {n!r}")
        if n > len(self._free):
            raise self.out_of_capacity(f"asked for {n} {self.kind}s, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            assert self._refs[i] == 0, f"free {self.kind} {i} has refcount {self._refs[i]}"
            self._refs[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference on each id (repeats count). Every id must be referenced already."""
        counts = self._counted(ids)
        for i in counts:
            if self._refs[i] == 0:
                raise ValueError(f"incref of free {self.kind} {i}")
        for i, c in counts.items():
            self._refs[i] += c

    def decref(self, ids: Iterable[int]) -> list[int]:
        """One reference fewer on each id (repeats count); returns the ids freed, in order."""
        counts = self._counted(ids)
        for i, c in counts.items():
            if self._refs[i] < c:
                raise ValueError(f"decref of {self.kind} {i} by {c}, refcount is {self._refs[i]}")
        freed = []
        for i, c in counts.items():
            self._refs[i] -= c
            if self._refs[i] == 0:
                freed.append(i)
                self._free.append(i)
        return freed

    def refcount(self, i: int) -> int:
        return self._refs[self.check_id(i)]

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless free + referenced == size, no overlap, no duplicates."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError(f"{self.kind} free list has duplicates")
        if any(r < 0 for r in self._refs):
            raise IntegrityError(f"negative {self.kind} refcount")
        referenced = {i for i, r in enumerate(self._refs) if r > 0}
        if free & referenced:
            both = sorted(free & referenced)[:8]
            raise IntegrityError(f"{self.kind}s both free and referenced: {both}")
        if len(free) + len(referenced) != self.size:
            raise IntegrityError(
                f"{self.kind}s: free ({len(free)}) + referenced ({len(referenced)}) != {self.size}"
            )

    def check_id(self, i: int) -> int:
        """`i` as a Python int (numpy integers welcome); ValueError unless an id of this pool."""
        ok = not isinstance(i, bool) and hasattr(i, "__index__")
        if not ok or not 0 <= operator.index(i) < self.size:
            raise ValueError(f"{self.kind} id must be an int in [0, {self.size}), got {i!r}")
        return operator.index(i)

    def _counted(self, ids: Iterable[int]) -> Counter[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"expected an iterable of {self.kind} ids, got {ids!r}")
        return Counter(self.check_id(i) for i in ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, free={self.num_free})"


class PageAllocator(RefCountedPool):
    """MLA latent pages: page ids index `DecodeState.kv_pages[:, page]`."""

    kind = "page"
    out_of_capacity = OutOfPages


class SlotPool(RefCountedPool):
    """KDA state rows: slot ids index `DecodeState.kda[:, slot]` and `DecodeState.conv[:, slot]`."""

    kind = "slot"
    out_of_capacity = OutOfSlots
