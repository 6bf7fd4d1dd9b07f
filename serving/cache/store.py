"""Cache tiers below the device: the `CacheStore` interface and the `PageBlob` it stores.

Keys are `hashing.page_hash` digests (hex): they name a page by every token up to its end, so a key
means the same on every worker (the SGLang HiCache / Mooncake scheme). A blob holds one
page's MLA latents for every MLA layer and, optionally, the KDA checkpoint taken right after the
page's last token. Blobs are host numpy arrays; the engine does the device <-> host copies.

Contract of a store:
- `put(hash, blob) -> bool`: stores the blob (it may evict others to make room); False when it does
  not keep it (for example, larger than the whole store). Pages are immutable, so a put for a key
  already present never changes the latents; a store may keep an existing checkpoint when the new
  blob has none.
- `get(hash)`: the blob or None. `contains_prefix(hashes)`: how many leading hashes are present.
- Every method is safe to call from several threads.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PageBlob:
    """One page on the host.

    latents: [L_mla, page_size, width] any dtype (bf16 stored as uint16 or ml_dtypes, fp8 + scales
             packed into width: the store does not look inside)
    kda:     optional KDA recurrent state at the page's end, e.g. [L_kda, H, V, K] fp32
    conv:    optional KDA conv state at the page's end, e.g. [L_kda, W-1, 3*H*K]; given with `kda`
    """

    latents: np.ndarray
    kda: np.ndarray | None = None
    conv: np.ndarray | None = None

    def __post_init__(self):
        if not isinstance(self.latents, np.ndarray) or self.latents.ndim != 3:
            raise ValueError("PageBlob.latents must be a numpy array [L_mla, page_size, width]")
        if (self.kda is None) != (self.conv is None):
            raise ValueError("PageBlob.kda and PageBlob.conv come together (a checkpoint is both)")
        for name in ("kda", "conv"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, np.ndarray):
                raise ValueError(f"PageBlob.{name} must be a numpy array or None")

    @property
    def has_checkpoint(self) -> bool:
        return self.kda is not None

    @property
    def nbytes(self) -> int:
        extra = self.kda.nbytes + self.conv.nbytes if self.has_checkpoint else 0
        return int(self.latents.nbytes + extra)


class CacheStore(abc.ABC):
    """A tier below the device (host memory, a shared store), keyed by page hash."""

    @abc.abstractmethod
    def contains_prefix(self, hashes: Sequence[str]) -> int:
        """Number of consecutive leading `hashes` present (0 if the first is absent)."""

    @abc.abstractmethod
    def get(self, key: str) -> PageBlob | None:
        """The blob stored under `key`, or None."""

    def get_many(self, keys: Sequence[str]) -> list[PageBlob | None]:
        """`get` for several keys; a remote store overrides it with one round trip."""
        return [self.get(k) for k in keys]

    @abc.abstractmethod
    def put(self, key: str, blob: PageBlob) -> bool:
        """Store `blob` under `key`; False if the store does not keep it."""

    def clear(self) -> int:
        """Drops every blob this worker may drop (reset_prefix_cache); returns how many. A shared store
        that other workers rely on may keep its contents: the default drops nothing."""
        return 0

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int: ...
