"""`PoolStore`: the `CacheStore` of the shared cache pool server (pool_server.py), over TCP.

    store = PoolStore.from_url("pool://127.0.0.1:7790")
    store.put_many([(key, blob), ...]); store.contains_prefix(hashes); store.get_many(hashes)

- Batched: `contains_prefix` sends the whole hash chain in one request; `get_many` / `put_many` move a
  whole history in one round trip each (split only past `max_batch_bytes`).
- Thread-safe: each call borrows a connection from a small pool (a new one when all are busy), so
  threads never interleave frames on one socket.
- Never raises into the engine once constructed. A dead, hung or unreachable server (refused, reset,
  no reply within `op_timeout_s`, a garbled reply) makes the call answer "absent" (0 / None / False) and marks the pool down for
  `retry_after_s`: calls in that window answer "absent" at once, without touching the network; the first
  call after it tries one fresh connection (connect timeout `connect_timeout_s`). The outage is logged
  once when it starts and once when the pool is back. An error reply to a request the server did not
  accept (should not happen: the client validates what it sends) is logged and answered "absent".

Blob encoding (`encode_blob` / `decode_blob`, also used by mooncake_store.py) is pool_wire.py's
descriptor: [[name, dtype, shape, nbytes], ...] + the arrays' C-order bytes, no pickle.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence

import msgpack
import numpy as np

from serving.cache import pool_wire as wire
from serving.cache.store import CacheStore, PageBlob

log = logging.getLogger(__name__)

_MAX_REPLY_BYTES = 1 << 34  # a reply is at most what we asked for; this only bounds a garbled length
_BLOB_HEADER = wire.FRAME  # reuse the frame layout for self-contained blobs (Mooncake objects)


# --- blob codec ------------------------------------------------------------------------------------------
def _dtype_name(arr: np.ndarray) -> str:
    name = arr.dtype.name
    if name not in wire.DTYPE_ITEMSIZE or arr.dtype.itemsize != wire.DTYPE_ITEMSIZE[name]:
        raise ValueError(f"dtype {arr.dtype} cannot be stored (allowed: {sorted(wire.DTYPE_ITEMSIZE)})")
    return name


def encode_blob(blob: PageBlob) -> tuple[list, list[memoryview]]:
    """(descriptor [[name, dtype, shape, nbytes], ...], the arrays' bytes as C-order buffers)."""
    if not isinstance(blob, PageBlob):
        raise ValueError(f"blob must be a PageBlob, got {type(blob).__name__}")
    arrays, buffers = [], []
    for name in wire.ARRAY_NAMES:
        arr = getattr(blob, name)
        if arr is None:
            continue
        arr = np.ascontiguousarray(arr)
        arrays.append([name, _dtype_name(arr), list(arr.shape), int(arr.nbytes)])
        buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))
    return arrays, buffers


def decode_blob(arrays: list, data, offset: int = 0) -> tuple[PageBlob, int]:
    """The PageBlob whose descriptor is `arrays` and whose bytes start at data[offset]; returns it and
    the offset just past it. Arrays are views of `data` (no copy). ValueError if they do not fit."""
    arrays, total, _ = wire.check_arrays(arrays)
    if offset + total > len(data):
        raise ValueError(f"blob needs {total} bytes at offset {offset}, only {len(data) - offset} left")
    parts = {}
    for name, dtype, shape, nbytes in arrays:
        parts[name] = np.frombuffer(data, dtype=_np_dtype(dtype), count=nbytes // wire.DTYPE_ITEMSIZE[dtype],
                                    offset=offset).reshape(shape)
        offset += nbytes
    return PageBlob(**parts), offset


def _np_dtype(name: str) -> np.dtype:
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes  # a jax dependency

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def blob_to_bytes(blob: PageBlob) -> bytes:
    """One self-describing object: frame prefix (MAGIC, header_len, payload_len) + msgpack descriptor
    + the arrays' bytes. The Mooncake backend stores one of these per page key."""
    arrays, buffers = encode_blob(blob)
    size = sum(len(b) for b in buffers)
    return b"".join([wire.pack_frame({"arrays": arrays}, size), *buffers])


def blob_from_bytes(data) -> PageBlob:
    """Inverse of `blob_to_bytes` (arrays are views of `data`); ValueError if it is not one."""
    if len(data) < _BLOB_HEADER.size:
        raise ValueError(f"a blob object has at least {_BLOB_HEADER.size} bytes, got {len(data)}")
    magic, header_len, payload_len = _BLOB_HEADER.unpack_from(data, 0)
    if magic != wire.MAGIC or _BLOB_HEADER.size + header_len + payload_len != len(data):
        raise ValueError("not a blob object (bad magic or lengths)")
    header = msgpack.unpackb(bytes(data[_BLOB_HEADER.size:_BLOB_HEADER.size + header_len]), raw=False)
    if not isinstance(header, dict):
        raise ValueError("blob header must be a map")
    blob, end = decode_blob(header.get("arrays"), data, _BLOB_HEADER.size + header_len)
    if end != len(data):
        raise ValueError("blob object has trailing bytes")
    return blob


def parse_host_port(url: str, scheme: str) -> tuple[str, int, dict[str, str]]:
    """`scheme://host:port[?k=v&...]` -> (host, port, query); ValueError with the expected form."""
    if not isinstance(url, str):
        raise ValueError(f"expected a {scheme}://host:port URL, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != scheme or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"expected a {scheme}://host:port URL, got {url!r}")
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    return parts.hostname, port, query


# --- the client ------------------------------------------------------------------------------------------
class PoolUnavailable(ConnectionError):
    """Raised inside the client only; public methods turn it into "absent". `skipped`: the pool was
    already marked down and no connection was tried."""

    def __init__(self, reason: str, *, skipped: bool = False):
        super().__init__(reason)
        self.skipped = skipped


class PoolStore(CacheStore):
    """The shared pool server as a `CacheStore`. Thread-safe; never raises once constructed (see module doc)."""

    tier = "shared"  # how the engine labels hits from this store (stats: prefix_hit_tokens_by_tier)

    def __init__(self, host: str = "127.0.0.1", port: int = 7790, *, connect_timeout_s: float = 0.5,
                 op_timeout_s: float = 5.0, retry_after_s: float = 2.0, max_idle_connections: int = 4,
                 max_batch_bytes: int = 256 << 20, namespace: str = ""):
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty str, got {host!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port must be an int in (0, 65536), got {port!r}")
        for name, value in (("connect_timeout_s", connect_timeout_s), ("op_timeout_s", op_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(retry_after_s, (int, float)) or retry_after_s < 0:
            raise ValueError(f"retry_after_s must be a non-negative number, got {retry_after_s!r}")
        if not isinstance(max_idle_connections, int) or max_idle_connections < 1:
            raise ValueError(f"max_idle_connections must be a positive int, got {max_idle_connections!r}")
        if not isinstance(max_batch_bytes, int) or max_batch_bytes <= 0:
            raise ValueError(f"max_batch_bytes must be a positive int, got {max_batch_bytes!r}")
        if not isinstance(namespace, str) or len(namespace) > 128:
            raise ValueError(f"namespace must be a str of at most 128 chars, got {namespace!r}")
        self.host, self.port = host, port
        self.namespace = namespace  # prefixed to every key: page hashes name tokens, not models
        self.connect_timeout_s, self.op_timeout_s = float(connect_timeout_s), float(op_timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.max_idle_connections = max_idle_connections
        self.max_batch_bytes = max_batch_bytes
        self._idle: list[socket.socket] = []  # connected sockets nobody is using
        self._lock = threading.Lock()  # guards _idle, _down_until, _down, counters
        self._down_until = 0.0
        self._down = False
        self._capacity = 0
        self._counts = dict(hits=0, misses=0, puts=0, stored=0, errors=0, skipped_while_down=0)

    @classmethod
    def from_url(cls, url: str, **kwargs) -> "PoolStore":
        """`pool://host:port[?namespace=..&connect_timeout_s=..&op_timeout_s=..&retry_after_s=..]`."""
        host, port, query = parse_host_port(url, "pool")
        if "namespace" in query:
            kwargs.setdefault("namespace", query.pop("namespace"))
        for key, value in query.items():
            if key not in ("connect_timeout_s", "op_timeout_s", "retry_after_s"):
                raise ValueError(f"unknown pool URL option {key!r} in {url!r}")
            try:
                kwargs.setdefault(key, float(value))
            except ValueError:
                raise ValueError(f"pool URL option {key}={value!r} is not a number") from None
        return cls(host, port, **kwargs)

    def __repr__(self) -> str:
        return f"PoolStore(pool://{self.host}:{self.port})"

    # --- connection handling ---------------------------------------------------------------------------
    def _borrow(self, fresh: bool = False) -> tuple[socket.socket, bool]:
        """(a connection, whether it is a reused idle one). `fresh`: always a new connection."""
        with self._lock:
            if self._idle and not fresh:
                return self._idle.pop(), True
            if self._down and time.monotonic() < self._down_until:
                self._counts["skipped_while_down"] += 1
                raise PoolUnavailable("pool marked down", skipped=True)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as e:
            raise PoolUnavailable(f"connect: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.op_timeout_s)
        return sock, False

    def _give_back(self, sock) -> None:
        with self._lock:
            if self._down:
                log.warning("cache pool %s:%d reachable again", self.host, self.port)
                self._down = False
            if len(self._idle) < self.max_idle_connections:
                self._idle.append(sock)
                return
        sock.close()

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._down_until = time.monotonic() + self.retry_after_s
            first = not self._down
            self._down = True
        for sock in idle:
            sock.close()
        if first:
            log.warning("cache pool %s:%d unavailable (%s): answering 'absent', retrying every %.1f s",
                        self.host, self.port, reason, self.retry_after_s)

    def _call(self, header: dict, buffers: Sequence = ()) -> tuple[dict, bytearray] | None:
        """One request/reply. None (after marking the pool down) if the server cannot be reached or the
        exchange breaks; None (logged) if the server answers with an error. A reused idle connection
        that turns out dead (the server restarted since) is retried once on a fresh one: every op is
        idempotent (puts of immutable pages), and a restart should not cost a back-off of misses."""
        fresh = False
        while True:
            try:
                sock, reused = self._borrow(fresh)
            except PoolUnavailable as e:
                if not e.skipped:
                    self._mark_down(str(e))
                return None
            try:
                wire.send_frame(sock, header, buffers)
                reply, payload = wire.recv_frame(sock, wire.MAX_HEADER_BYTES, _MAX_REPLY_BYTES)
            except (OSError, wire.ProtocolError, ValueError, MemoryError) as e:  # MemoryError: a garbled length
                sock.close()
                if reused and isinstance(e, ConnectionError):  # reset / closed / EOF, not a timeout
                    fresh = True
                    continue
                self._mark_down(f"{type(e).__name__}: {e}")
                return None
            break
        self._give_back(sock)
        if reply.get("ok") is not True:
            with self._lock:
                self._counts["errors"] += 1
            log.error("cache pool %s:%d refused %s: %s", self.host, self.port, header.get("op"), reply.get("error"))
            return None
        return reply, payload

    @property
    def available(self) -> bool:
        """False while the pool is marked down (no network call)."""
        with self._lock:
            return not self._down

    def ping(self) -> bool:
        """True if the server answers now (bypasses nothing: a down pool inside its back-off is False)."""
        return self._call({"op": "ping"}) is not None

    # --- CacheStore ------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key or len(self.namespace) + len(key) > wire.MAX_KEY_CHARS:
            raise ValueError(f"key must be a str of 1..{wire.MAX_KEY_CHARS - len(self.namespace)} chars, got {key!r}")
        return self.namespace + key

    def contains_prefix(self, hashes: Sequence[str]) -> int:
        keys = [self._key(h) for h in hashes]
        if not keys:
            return 0
        n = 0
        for start in range(0, len(keys), wire.MAX_KEYS):
            chunk = keys[start:start + wire.MAX_KEYS]
            result = self._call({"op": "contains_prefix", "keys": chunk})
            if result is None:
                return n
            got = result[0].get("n")
            if not isinstance(got, int) or not 0 <= got <= len(chunk):
                self._mark_down(f"bad contains_prefix reply {got!r}")
                return n
            n += got
            if got < len(chunk):
                break
        return n

    def get(self, key: str) -> PageBlob | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[PageBlob | None]:
        """Blobs for `keys` (None where absent), in one round trip per `wire.MAX_KEYS` keys."""
        keys = [self._key(k) for k in keys]
        out: list[PageBlob | None] = []
        for start in range(0, len(keys), wire.MAX_KEYS):
            chunk = keys[start:start + wire.MAX_KEYS]
            result = self._call({"op": "get_many", "keys": chunk})
            blobs = self._decode_get(result, len(chunk)) if result is not None else None
            out.extend(blobs if blobs is not None else [None] * len(chunk))
        with self._lock:
            found = sum(b is not None for b in out)
            self._counts["hits"] += found
            self._counts["misses"] += len(out) - found
        return out

    def _decode_get(self, result, n: int) -> list[PageBlob | None] | None:
        reply, payload = result
        descriptors = reply.get("blobs")
        try:
            if not isinstance(descriptors, list) or len(descriptors) != n:
                raise ValueError(f"expected {n} blob descriptors")
            out, offset = [], 0
            for arrays in descriptors:
                if arrays is None:
                    out.append(None)
                    continue
                blob, offset = decode_blob(arrays, payload, offset)
                out.append(blob)
            if offset != len(payload):
                raise ValueError("reply payload has trailing bytes")
            return out
        except ValueError as e:
            self._mark_down(f"garbled get_many reply: {e}")
            return None

    def put(self, key: str, blob: PageBlob) -> bool:
        return self.put_many([(key, blob)])[0]

    def put_many(self, items: Sequence[tuple[str, PageBlob]]) -> list[bool]:
        """Store each (key, blob); per item, whether the pool kept it. ValueError on a bad key/blob (a
        caller bug, checked before anything is sent); a dead pool answers all False."""
        encoded = []
        for key, blob in items:
            key = self._key(key)
            arrays, buffers = encode_blob(blob)
            encoded.append((key, arrays, buffers, sum(len(b) for b in buffers)))
        stored: list[bool] = []
        batch, batch_bytes = [], 0
        for entry in encoded + [None]:
            if entry is None or (batch and (batch_bytes + entry[3] > self.max_batch_bytes or len(batch) >= wire.MAX_KEYS)):
                if batch:
                    stored.extend(self._put_batch(batch))
                batch, batch_bytes = [], 0
            if entry is not None:
                batch.append(entry)
                batch_bytes += entry[3]
        with self._lock:
            self._counts["puts"] += len(stored)
            self._counts["stored"] += sum(stored)
        return stored

    def _put_batch(self, batch) -> list[bool]:
        header = {"op": "put_many", "items": [{"key": key, "arrays": arrays} for key, arrays, _, _ in batch]}
        result = self._call(header, [buf for _, _, buffers, _ in batch for buf in buffers])
        if result is None:
            return [False] * len(batch)
        stored = result[0].get("stored")
        if not isinstance(stored, list) or len(stored) != len(batch):
            self._mark_down("bad put_many reply")
            return [False] * len(batch)
        return [x is True for x in stored]

    # clear(): the CacheStore default (drops nothing): other workers rely on the shared pool.

    def server_stats(self) -> dict[str, int]:
        """The server's counters (blobs, used/capacity bytes, hits, evictions, ...); {} when down."""
        result = self._call({"op": "stats"})
        stats = result[0].get("stats") if result is not None else None
        return stats if isinstance(stats, dict) else {}

    @property
    def capacity_bytes(self) -> int:
        """The server's capacity (asked once, then remembered); 0 while it was never reachable."""
        if not self._capacity:
            self._capacity = int(self.server_stats().get("capacity_bytes", 0))
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes held by the server now (one round trip); 0 when down."""
        return int(self.server_stats().get("used_bytes", 0))

    def stats(self) -> dict[str, int]:
        """This client's counters: hits/misses of gets, puts/stored, error replies, calls skipped while
        down, and whether the pool is up."""
        with self._lock:
            return {**self._counts, "available": int(not self._down)}

    def close(self) -> None:
        """Close idle connections (borrowed ones close when their call ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
