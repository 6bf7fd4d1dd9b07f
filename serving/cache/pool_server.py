"""The embedded shared cache pool: a small TCP server holding encoded `PageBlob`s by page key, LRU by bytes.

    python -m serving.cache.pool_server --port 7790 --capacity-gb 8 [--host 127.0.0.1]
    python serving/cache/pool_server.py --port 0 ...     (same, without importing the serving package)

Every worker on a host points a `PoolStore` (pool_client.py) at it, so a page any worker published is a
hit for all of them (keys are the chained page hashes of hashing.py). The server never decodes arrays: it
validates each blob's descriptor and keeps its raw bytes, so this file imports only the standard library
and msgpack (a flax dependency) and starts in well under a second when run as a script.

Wire format (both directions), never pickle:

    frame   = MAGIC (4 bytes b"K3P1") | header_len u32 | payload_len u64   (network order, 16 bytes)
              | header (msgpack map, header_len bytes) | payload (payload_len raw bytes)
    blob    = {"arrays": [[name, dtype, shape, nbytes], ...]}: names "latents" then optionally "kda",
              "conv" (both or neither); its bytes are the arrays' C-order bytes concatenated in that order
    ops     ping                         -> {ok}
            contains_prefix {keys}       -> {ok, n}        leading keys present, one round trip
            get_many {keys}              -> {ok, blobs: [blob | None]}, payload: found blobs' bytes in order
            put_many {items: [{key, arrays}]}, payload: the blobs' bytes in order -> {ok, stored: [bool]}
            stats                        -> {ok, stats}
    errors  {ok: False, error: str}. A request whose header does not validate gets an error reply and
            the connection stays usable; a broken frame (bad magic, over-size lengths, truncated) gets an
            error reply and the connection is closed (its stream cannot be resynchronised). Either way
            the server keeps serving everyone else.

Store semantics match `HostStore` (and the `CacheStore` contract): a put larger than the whole capacity
is refused; otherwise least recently used blobs go until it fits; a put for a present key keeps the old
blob when the new one has no KDA checkpoint and the old one has; `get_many` refreshes recency,
`contains_prefix` only looks.
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
import socketserver
import struct
import sys
import threading
from collections import OrderedDict

import msgpack

log = logging.getLogger(__name__)

MAGIC = b"K3P1"
FRAME = struct.Struct("!4sIQ")
MAX_HEADER_BYTES = 8 << 20  # 65536 keys of 64 hex chars plus descriptors fit several times over
MAX_KEYS = 65536
MAX_KEY_CHARS = 256
MAX_NDIM = 8
DEFAULT_MAX_REQUEST_BYTES = 1 << 30
_GIB = 1 << 30

# dtypes a blob may carry and their item sizes; names as numpy spells them (ml_dtypes for bf16/fp8)
DTYPE_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
ARRAY_NAMES = ("latents", "kda", "conv")


class ProtocolError(ValueError):
    """A request (or reply) that breaks the wire format; the message says what."""


class BadHeader(ProtocolError):
    """A well-framed message whose header is wrong: the stream is still in step."""


# --- framing (shared with pool_client) --------------------------------------------------------------
def pack_frame(header: dict, payload_len: int = 0) -> bytes:
    """Frame prefix + msgpack header; the caller sends `payload_len` payload bytes after it."""
    body = msgpack.packb(header, use_bin_type=True)
    return FRAME.pack(MAGIC, len(body), payload_len) + body


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes from sock; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame_head(sock: socket.socket, max_header: int, max_payload: int) -> tuple[dict | BadHeader, int]:
    """A frame's prefix and header: (header map, or the BadHeader describing why it is not one; payload
    length). The payload is still in the stream. ProtocolError on a bad magic or an over-size length."""
    magic, header_len, payload_len = FRAME.unpack(recv_exact(sock, FRAME.size))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if header_len > max_header:
        raise ProtocolError(f"header of {header_len} bytes exceeds the limit of {max_header}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
    raw = recv_exact(sock, header_len)
    try:
        header = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several types for garbage
        return BadHeader(f"header is not valid msgpack: {e}"), payload_len
    if not isinstance(header, dict):
        return BadHeader("header must be a msgpack map"), payload_len
    return header, payload_len


def recv_frame(sock: socket.socket, max_header: int, max_payload: int) -> tuple[dict, bytearray]:
    """One whole frame: (header map, payload). ProtocolError (BadHeader for a bad header) as above."""
    header, payload_len = recv_frame_head(sock, max_header, max_payload)
    payload = recv_exact(sock, payload_len) if payload_len else bytearray()
    if isinstance(header, BadHeader):
        raise header
    return header, payload


class PayloadReader:
    """The payload of the frame being served, read straight into the buffers that keep it (one copy
    from the socket, no staging buffer). `drain()` skips whatever was not read (after a bad request)."""

    def __init__(self, sock: socket.socket, nbytes: int):
        self.sock, self.left = sock, nbytes

    def read(self, n: int) -> bytearray:
        if n > self.left:
            raise ProtocolError(f"payload too short: {n} more bytes needed, {self.left} left")
        self.left -= n
        return recv_exact(self.sock, n)

    def drain(self) -> None:
        scratch = bytearray(min(self.left, 1 << 20))
        while self.left:
            k = self.sock.recv_into(scratch, min(self.left, len(scratch)))
            if k == 0:
                raise ConnectionError("peer closed mid-payload")
            self.left -= k


def check_key(key) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
        raise ProtocolError(f"a key must be a str of 1..{MAX_KEY_CHARS} chars, got {str(key)[:80]!r}")
    return key


def check_keys(keys) -> list[str]:
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise ProtocolError(f"keys must be a list of at most {MAX_KEYS} keys")
    return [check_key(k) for k in keys]


def check_arrays(arrays) -> tuple[list, int, bool]:
    """Validate a blob descriptor; returns (descriptor, total bytes, has_checkpoint)."""
    if not isinstance(arrays, list) or not 1 <= len(arrays) <= len(ARRAY_NAMES):
        raise ProtocolError("arrays must be a list of 1..3 [name, dtype, shape, nbytes] entries")
    names = []
    total = 0
    for entry in arrays:
        if not isinstance(entry, list) or len(entry) != 4:
            raise ProtocolError("each array is [name, dtype, shape, nbytes]")
        name, dtype, shape, nbytes = entry
        if name not in ARRAY_NAMES or name in names:
            raise ProtocolError(f"array name must be one of {ARRAY_NAMES}, each once; got {name!r}")
        if dtype not in DTYPE_ITEMSIZE:
            raise ProtocolError(f"dtype {dtype!r} not allowed (allowed: {sorted(DTYPE_ITEMSIZE)})")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ProtocolError(f"shape must be a list of at most {MAX_NDIM} non-negative ints, got {shape!r}")
        if name == "latents" and len(shape) != 3:
            raise ProtocolError(f"latents must be 3-D [L_mla, page_size, width], got shape {shape}")
        if (not isinstance(nbytes, int) or isinstance(nbytes, bool)
                or nbytes != math.prod(shape) * DTYPE_ITEMSIZE[dtype]):
            raise ProtocolError(f"{name}: nbytes {nbytes!r} != prod({shape}) * itemsize of {dtype}")
        names.append(name)
        total += nbytes
    if names[0] != "latents" or ("kda" in names) != ("conv" in names):
        raise ProtocolError("a blob is latents, then optionally kda and conv together")
    return arrays, total, "kda" in names


# --- the store ---------------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("arrays", "data", "has_checkpoint")

    def __init__(self, arrays: list, data: bytearray, has_checkpoint: bool):
        self.arrays, self.data, self.has_checkpoint = arrays, data, has_checkpoint


class BlobLRU:
    """Raw blobs by key, LRU by payload bytes; one lock. The server's whole state."""

    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity = capacity_bytes
        self._blobs: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._counts = dict(hits=0, misses=0, puts=0, evictions=0, rejected=0, bad_requests=0)

    def contains_prefix(self, keys: list[str]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._blobs:
                    break
                n += 1
            return n

    def get_many(self, keys: list[str]) -> list[_Entry | None]:
        with self._lock:
            out = []
            for key in keys:
                entry = self._blobs.get(key)
                if entry is None:
                    self._counts["misses"] += 1
                else:
                    self._counts["hits"] += 1
                    self._blobs.move_to_end(key)
                out.append(entry)
            return out

    def put(self, key: str, entry: _Entry) -> bool:
        size = len(entry.data)
        with self._lock:
            self._counts["puts"] += 1
            old = self._blobs.get(key)
            if old is not None and old.has_checkpoint and not entry.has_checkpoint:
                self._blobs.move_to_end(key)
                return True
            if size > self.capacity:
                self._counts["rejected"] += 1
                return False
            if old is not None:
                del self._blobs[key]
                self._used -= len(old.data)
            while self._used + size > self.capacity:
                _, evicted = self._blobs.popitem(last=False)
                self._used -= len(evicted.data)
                self._counts["evictions"] += 1
            self._blobs[key] = entry
            self._used += size
            return True

    def count_bad_request(self) -> None:
        with self._lock:
            self._counts["bad_requests"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"blobs": len(self._blobs), "used_bytes": self._used, "capacity_bytes": self.capacity,
                    **self._counts}


# --- the server --------------------------------------------------------------------------------------
def handle_request(store: BlobLRU, header: dict, payload: PayloadReader) -> tuple[dict, list]:
    """One request -> (reply header, reply payload buffers). Raises ProtocolError, possibly with part of
    the payload unread (the caller drains it)."""
    op = header.get("op")
    if op != "put_many" and payload.left:
        raise ProtocolError(f"{op!r} takes no payload")
    if op == "ping":
        return {"ok": True}, []
    if op == "stats":
        return {"ok": True, "stats": store.stats()}, []
    if op == "contains_prefix":
        return {"ok": True, "n": store.contains_prefix(check_keys(header.get("keys")))}, []
    if op == "get_many":
        entries = store.get_many(check_keys(header.get("keys")))
        return ({"ok": True, "blobs": [None if e is None else e.arrays for e in entries]},
                [e.data for e in entries if e is not None])
    if op == "put_many":
        items = header.get("items")
        if not isinstance(items, list) or len(items) > MAX_KEYS:
            raise ProtocolError(f"items must be a list of at most {MAX_KEYS} {{key, arrays}} maps")
        parsed = []
        offset = 0
        for item in items:  # validate everything before storing anything
            if not isinstance(item, dict):
                raise ProtocolError("each item is a {key, arrays} map")
            key = check_key(item.get("key"))
            arrays, nbytes, has_ckpt = check_arrays(item.get("arrays"))
            parsed.append((key, arrays, offset, nbytes, has_ckpt))
            offset += nbytes
        if offset != payload.left:
            raise ProtocolError(f"payload has {payload.left} bytes, the descriptors describe {offset}")
        data = [payload.read(n) for _, _, _, n, _ in parsed]  # all of it before storing any
        stored = [store.put(key, _Entry(arrays, blob_bytes, ck))
                  for (key, arrays, _, _, ck), blob_bytes in zip(parsed, data)]
        return {"ok": True, "stored": stored}, []
    raise ProtocolError(f"unknown op {op!r} (ping, stats, contains_prefix, get_many, put_many)")


def send_frame(sock: socket.socket, header: dict, buffers) -> None:
    """Frame prefix + header + the payload buffers, gathered into as few syscalls as the kernel allows
    (sendmsg with up to 512 buffers each): a hundred small pages are one write, not a hundred."""
    pending = [memoryview(pack_frame(header, sum(len(b) for b in buffers)))]
    pending += [memoryview(b).cast("B") for b in buffers if len(b)]
    first = 0  # pending[:first] are sent
    while first < len(pending):
        sent = sock.sendmsg(pending[first:first + 512])
        while sent:  # step past what went out; keep the unsent tail of a partly sent buffer
            if sent >= len(pending[first]):
                sent -= len(pending[first])
                first += 1
            else:
                pending[first] = pending[first][sent:]
                sent = 0


def send_reply(sock: socket.socket, header: dict, buffers: list) -> None:
    send_frame(sock, header, buffers)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: PoolServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.track(sock, True)
        try:
            self._serve(server, sock)
        finally:
            server.track(sock, False)

    def _serve(self, server: "PoolServer", sock: socket.socket) -> None:
        while True:
            try:
                header, payload_len = recv_frame_head(sock, MAX_HEADER_BYTES, server.max_request_bytes)
            except ConnectionError:
                return  # client went away (possibly mid-frame): nothing to answer
            except (ProtocolError, OSError, struct.error) as e:
                server.store.count_bad_request()
                self._try_reply({"ok": False, "error": str(e)}, [])
                return  # the stream is out of step: close it
            payload = PayloadReader(sock, payload_len)
            try:
                if isinstance(header, BadHeader):
                    raise header
                reply, buffers = handle_request(server.store, header, payload)
            except ConnectionError:
                return
            except ProtocolError as e:
                server.store.count_bad_request()
                reply, buffers = {"ok": False, "error": str(e)}, []
            except Exception as e:  # a bug must cost one request, not the server
                log.exception("pool server: request failed")
                reply, buffers = {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}, []
            try:
                payload.drain()  # keep the stream in step after a refused request
            except (ConnectionError, OSError):
                return
            if not self._try_reply(reply, buffers):
                return

    def _try_reply(self, header: dict, buffers: list) -> bool:
        try:
            send_reply(self.request, header, buffers)
            return True
        except OSError:
            return False


class PoolServer(socketserver.ThreadingTCPServer):
    """The pool as a threaded TCP server (one thread per client connection). `serve_forever()` to run,
    `shutdown(); server_close()` to stop. `port=0` picks a free port (see `.port`)."""

    daemon_threads = True
    block_on_close = False  # stop() drops the connections; nothing to wait for
    allow_reuse_address = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, capacity_bytes: int,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
        if not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be a positive int, got {max_request_bytes!r}")
        self.store = BlobLRU(capacity_bytes)
        self.max_request_bytes = max_request_bytes
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    def track(self, sock: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            (self._connections.add if open_ else self._connections.discard)(sock)

    def stop(self) -> None:
        """Stop serving and drop every client connection (as if the process had died)."""
        self.shutdown()
        with self._connections_lock:
            connections, self._connections = self._connections, set()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.server_close()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start_in_thread(self) -> threading.Thread:
        """Serve from a daemon thread (tests, or a worker embedding the pool); returns the thread."""
        thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                  name=f"pool-server:{self.port}", daemon=True)
        thread.start()
        return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="k3jax shared cache pool server (page blobs by key, LRU)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port, printed at start)")
    parser.add_argument("--capacity-gb", type=float, required=True, help="bytes of blobs kept, in GiB (2**30)")
    parser.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_BYTES / (1 << 20),
                        help="largest request payload accepted, MiB (default 1024)")
    args = parser.parse_args(argv)
    if not args.capacity_gb > 0:
        parser.error("--capacity-gb must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pool-server %(levelname)s %(message)s")
    server = PoolServer(args.host, args.port, capacity_bytes=int(args.capacity_gb * _GIB),
                        max_request_bytes=max(1, int(args.max_request_mb * (1 << 20))))
    # the first stdout line is the address: a parent that passed --port 0 reads the port from it
    print(f"pool-server listening on {args.host}:{server.port} capacity_bytes={server.store.capacity}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
