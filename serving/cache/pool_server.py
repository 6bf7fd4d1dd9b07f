"""The embedded shared cache pool: a small TCP server holding encoded `PageBlob`s by page key, LRU by bytes.

    python -m serving.cache.pool_server --port 7790 --capacity-gb 8 [--host 127.0.0.1]
    python serving/cache/pool_server.py --port 0 ...     (same, without importing the serving package)

Every worker on a host points a `PoolStore` (pool_client.py) at it, so a page any worker published is a
hit for all of them (keys are the chained page hashes of hashing.py). The server never decodes arrays: it
validates each blob's descriptor and keeps its raw bytes, so this file imports only the standard library
and msgpack (a flax dependency) and starts in well under a second when run as a script.

Wire format (both directions; frames and blob descriptors in pool_wire.py), never pickle:

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
import socket
import socketserver
import struct
import sys
import threading
from collections import OrderedDict

if __package__:
    from serving.cache import pool_wire as wire
else:  # run as a file (python serving/cache/pool_server.py): its folder is sys.path[0]; no package import
    import pool_wire as wire  # type: ignore[no-redef]

log = logging.getLogger(__name__)
_GIB = 1 << 30


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
def handle_request(store: BlobLRU, header: dict, payload: wire.PayloadReader) -> tuple[dict, list]:
    """One request -> (reply header, reply payload buffers). Raises wire.ProtocolError, possibly with part of
    the payload unread (the caller drains it)."""
    op = header.get("op")
    if op != "put_many" and payload.left:
        raise wire.ProtocolError(f"{op!r} takes no payload")
    if op == "ping":
        return {"ok": True}, []
    if op == "stats":
        return {"ok": True, "stats": store.stats()}, []
    if op == "contains_prefix":
        return {"ok": True, "n": store.contains_prefix(wire.check_keys(header.get("keys")))}, []
    if op == "get_many":
        entries = store.get_many(wire.check_keys(header.get("keys")))
        return ({"ok": True, "blobs": [None if e is None else e.arrays for e in entries]},
                [e.data for e in entries if e is not None])
    if op == "put_many":
        items = header.get("items")
        if not isinstance(items, list) or len(items) > wire.MAX_KEYS:
            raise wire.ProtocolError(f"items must be a list of at most {wire.MAX_KEYS} {{key, arrays}} maps")
        parsed = []
        offset = 0
        for item in items:  # validate everything before storing anything
            if not isinstance(item, dict):
                raise wire.ProtocolError("each item is a {key, arrays} map")
            key = wire.check_key(item.get("key"))
            arrays, nbytes, has_ckpt = wire.check_arrays(item.get("arrays"))
            parsed.append((key, arrays, offset, nbytes, has_ckpt))
            offset += nbytes
        if offset != payload.left:
            raise wire.ProtocolError(f"payload has {payload.left} bytes, the descriptors describe {offset}")
        data = [payload.read(n) for _, _, _, n, _ in parsed]  # all of it before storing any
        stored = [store.put(key, _Entry(arrays, blob_bytes, ck))
                  for (key, arrays, _, _, ck), blob_bytes in zip(parsed, data)]
        return {"ok": True, "stored": stored}, []
    raise wire.ProtocolError(f"unknown op {op!r} (ping, stats, contains_prefix, get_many, put_many)")


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
                header, payload_len = wire.recv_frame_head(sock, wire.MAX_HEADER_BYTES, server.max_request_bytes)
            except ConnectionError:
                return  # client went away (possibly mid-frame): nothing to answer
            except (wire.ProtocolError, OSError, struct.error) as e:
                server.store.count_bad_request()
                self._try_reply({"ok": False, "error": str(e)}, [])
                return  # the stream is out of step: close it
            payload = wire.PayloadReader(sock, payload_len)
            try:
                if isinstance(header, wire.BadHeader):
                    raise header
                reply, buffers = handle_request(server.store, header, payload)
            except ConnectionError:
                return
            except wire.ProtocolError as e:
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
            wire.send_frame(self.request, header, buffers)
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
                 max_request_bytes: int = wire.DEFAULT_MAX_REQUEST_BYTES):
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
    parser.add_argument("--max-request-mb", type=float, default=wire.DEFAULT_MAX_REQUEST_BYTES / (1 << 20),
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
