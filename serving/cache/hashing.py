"""Page keys shared by every cache tier: chained SHA-256 over token ids.

    page_hash(tokens, parent) = sha256(parent digest bytes (none for the first page)
                                       + each token as a 4-byte little-endian uint32).hexdigest()

A key names a page by every token up to its end, so equal keys mean equal contents on every
worker (the SGLang HiCache / Mooncake scheme): the device cache, host tier and shared store use it.
`prefix_hashes(tokens, page_size)` gives the keys of all *full* pages; a partial last page has none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np


def page_hash(tokens: Sequence[int], parent: str | None) -> str:
    """SHA-256 of (parent digest bytes, if any) + tokens as little-endian uint32; 64 hex chars."""
    return _page_hash(as_u32_tokens(tokens, allow_empty=False), _parent_bytes(parent))


def prefix_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
    """Chained hashes of every *full* page of `tokens` (a partial last page has none)."""
    check_page_size(page_size)
    arr = as_u32_tokens(tokens, allow_empty=True)
    return list(iter_page_hashes(arr, page_size, len(arr) // page_size))


def _page_hash(page_u32: np.ndarray, parent: bytes) -> str:
    return hashlib.sha256(parent + page_u32.tobytes()).hexdigest()


def iter_page_hashes(arr: np.ndarray, page_size: int, num_pages: int) -> Iterator[str]:
    """Chained hashes of the first `num_pages` pages of `arr` (from `as_u32_tokens`), lazily."""
    parent = b""
    for i in range(num_pages):
        h = _page_hash(arr[i * page_size : (i + 1) * page_size], parent)
        yield h
        parent = bytes.fromhex(h)


def as_u32_tokens(tokens: Sequence[int], *, allow_empty: bool) -> np.ndarray:
    """`tokens` as little-endian uint32 [n]; ValueError unless 1-D ints in [0, 2**32)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError("tokens must be a 1-D sequence of ints")
    if arr.size == 0:
        if not allow_empty:
            raise ValueError("a page has at least one token")
        return np.zeros(0, dtype="<u4")
    if int(arr.min()) < 0 or int(arr.max()) >= 1 << 32:
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False)


def _parent_bytes(parent: str | None) -> bytes:
    if parent is None:
        return b""
    if not isinstance(parent, str) or len(parent) != 64:
        raise ValueError(f"parent must be None or a 64-char hex digest, got {parent!r}")
    try:
        digest = bytes.fromhex(parent)
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise ValueError(f"parent is not a hex SHA-256 digest: {parent!r}")
    return digest


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
