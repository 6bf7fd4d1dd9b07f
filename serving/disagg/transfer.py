"""KV transfer between a prefill worker and a decode worker: one interface, two transports.

    payload = KVPayload(room, request_id, first_tokens, num_computed, cached_tokens, arrays)
    transport = make_transport("tcp" | "inprocess")
    listener = transport.listen(port, on_pull)           # prefill worker: its bootstrap port
    payload = transport.pull(host, port, room, timeout)  # decode worker, on a background thread

Pairing is SGLang's: the gateway sends (bootstrap_host, bootstrap_port, bootstrap_room) to both legs.
The prefill worker listens on its bootstrap port; the decode worker, once it has reserved memory for
the request, connects there and asks for its room. `on_pull(room, deadline)` (the prefill worker's)
blocks until the room's state is ready (it is read off the device at a step boundary of the prefill
engine) and returns the payload, or raises TransferError (unknown room after the deadline, expired).

Wire format (tcp), never pickle: every message is a frame

    b"K3KV" | u32 header length | msgpack header | raw array bytes, in header order

with header {"op": ..., ...}; arrays are listed in the header as [name, dtype, shape] and their bytes
follow in C order (bf16 as ml_dtypes bfloat16). A pull is {"op": "pull", "room": R}; the answer is
{"op": "kv", ...payload fields...} or {"op": "error", "message": ...}. The listener binds 127.0.0.1.

The in-process transport (both roles in one process) hands the payload's arrays over directly: a
registry maps port -> the listener's `on_pull`; nothing is serialised.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes  # noqa: F401 (registers bfloat16 & co with numpy, so np.dtype("bfloat16") works)
import msgpack
import numpy as np

from serving.cache import pool_wire

MAGIC = b"K3KV"
_HEAD = struct.Struct("!4sI")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 40  # one request's whole state (K3 at 1M tokens is ~20 GB); guards a garbled shape
# the dtypes a frame may carry (the cache pool's list: what a request's state is made of); anything else in a
# header is refused before any allocation
ALLOWED_DTYPES = frozenset(pool_wire.DTYPE_ITEMSIZE)
TRANSPORTS = ("tcp", "inprocess")


class TransferError(RuntimeError):
    """A transfer that failed (no such room, timed out, connection lost, malformed frame)."""


@dataclass
class KVPayload:
    """What a decode worker needs to continue a request the prefill worker started.

    first_tokens: the token(s) the prefill worker sampled (the decode leg's first output)
    num_computed: tokens whose KV/recurrent state is in `arrays` (the prompt length)
    arrays: ModelRunner.read_request's dict: "kv" [L_mla, pages, ps, C] latents, "kda"/"conv" the
        request's KDA row; with speculation also "draft" and "pending"
    """

    room: int
    request_id: str
    first_tokens: list[int]
    num_computed: int
    cached_tokens: int
    arrays: dict[str, np.ndarray]
    spec_pending: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def num_pages(self) -> int:
        return int(self.arrays["kv"].shape[1])


# --- frames --------------------------------------------------------------------------------------


def encode_frame(header: dict, arrays: dict[str, np.ndarray] | None = None) -> list[bytes | memoryview]:
    """The frame's pieces (header first, then each array's buffer), ready for sendall one by one."""
    arrays = arrays or {}
    listed = []
    buffers = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        listed.append([name, a.dtype.name, list(a.shape)])
        buffers.append(memoryview(a.reshape(-1).view(np.uint8)))  # bytes view: works for ml_dtypes too
    head = msgpack.packb({**header, "arrays": listed}, use_bin_type=True)
    return [_HEAD.pack(MAGIC, len(head)) + head, *buffers]


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    try:
        return pool_wire.recv_exact(sock, n)
    except ConnectionError as e:
        raise TransferError(f"connection lost: {e}") from None


def read_frame(sock: socket.socket) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of the next frame on `sock`; TransferError if it is not one of ours."""
    magic, size = _HEAD.unpack(bytes(_recv_exact(sock, _HEAD.size)))
    if magic != MAGIC or size > MAX_HEADER_BYTES:
        raise TransferError("not a k3jax KV-transfer frame")
    try:
        header = msgpack.unpackb(bytes(_recv_exact(sock, size)), raw=False)
        listed = header.pop("arrays", [])
        specs, total = [], 0
        for name, dtype, shape in listed:
            if dtype not in ALLOWED_DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"array {name!r}: dtype {dtype!r} / shape {shape!r} not accepted")
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            total += count * dt.itemsize
            specs.append((str(name), dt, tuple(shape), count))
        if total > MAX_PAYLOAD_BYTES:
            raise ValueError(f"payload of {total} bytes exceeds {MAX_PAYLOAD_BYTES}")
    except (ValueError, TypeError, AttributeError, msgpack.exceptions.ExtraData) as e:
        raise TransferError(f"malformed KV-transfer header: {e}") from None
    arrays = {name: np.frombuffer(_recv_exact(sock, count * dt.itemsize), dtype=dt).reshape(shape)
              for name, dt, shape, count in specs}
    return header, arrays


def send_frame(sock: socket.socket, header: dict, arrays: dict[str, np.ndarray] | None = None) -> int:
    return pool_wire.sendmsg_all(sock, encode_frame(header, arrays))


def _payload_header(p: KVPayload) -> dict:
    return {"op": "kv", "room": p.room, "request_id": p.request_id, "first_tokens": list(p.first_tokens),
            "num_computed": p.num_computed, "cached_tokens": p.cached_tokens, "spec_pending": list(p.spec_pending)}


def _payload_from(header: dict, arrays: dict[str, np.ndarray]) -> KVPayload:
    try:
        return KVPayload(room=int(header["room"]), request_id=str(header["request_id"]),
                         first_tokens=[int(t) for t in header["first_tokens"]], num_computed=int(header["num_computed"]),
                         cached_tokens=int(header["cached_tokens"]), arrays=arrays,
                         spec_pending=[int(t) for t in header.get("spec_pending", [])])
    except (KeyError, TypeError, ValueError) as e:
        raise TransferError(f"malformed KV payload header: {e}") from None


# --- transports ----------------------------------------------------------------------------------

# on_pull(room, deadline) -> KVPayload, on a listener thread; raises TransferError
PullHandler = Callable[[int, float], KVPayload]


class Listener:
    """A prefill worker's bootstrap/transfer endpoint; `port` is the bound one."""

    port: int

    def close(self) -> None: ...


class Transport:
    """listen (prefill side) and pull (decode side); see the module docstring."""

    name: str

    def listen(self, port: int, on_pull: PullHandler) -> Listener:
        raise NotImplementedError

    def pull(self, host: str, port: int, room: int, timeout_s: float) -> KVPayload:
        raise NotImplementedError


class _TcpListener(Listener):
    def __init__(self, port: int, on_pull: PullHandler, timeout_s: float):
        self._sock = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._on_pull, self._timeout_s = on_pull, timeout_s
        self._closed = False
        self.bytes_sent = 0
        threading.Thread(target=self._accept, name=f"kv-listener-{self.port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self._timeout_s)
                header, _ = read_frame(conn)
                if header.get("op") != "pull" or not isinstance(header.get("room"), int):
                    send_frame(conn, {"op": "error", "message": f"expected a pull, got {header.get('op')!r}"})
                    return
                wait = min(float(header.get("timeout_s", self._timeout_s)), self._timeout_s)
                try:
                    payload = self._on_pull(header["room"], time.monotonic() + wait)
                except TransferError as e:
                    send_frame(conn, {"op": "error", "message": str(e)})
                    return
                self.bytes_sent += send_frame(conn, _payload_header(payload), payload.arrays)
            except (OSError, TransferError, ValueError, msgpack.UnpackException):
                return  # the puller sees the connection drop

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the listener thread
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass


class TcpTransport(Transport):
    """Between processes: a TCP connection per transfer (loopback or LAN)."""

    name = "tcp"

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s

    def listen(self, port: int, on_pull: PullHandler) -> Listener:
        return _TcpListener(port, on_pull, self.timeout_s)

    def pull(self, host: str, port: int, room: int, timeout_s: float) -> KVPayload:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.settimeout(timeout_s)
                send_frame(sock, {"op": "pull", "room": int(room), "timeout_s": float(timeout_s)})
                header, arrays = read_frame(sock)
        except (OSError, ValueError, msgpack.UnpackException) as e:
            raise TransferError(f"KV pull of room {room} from {host}:{port} failed: {type(e).__name__}: {e}") from None
        if header.get("op") == "error":
            raise TransferError(f"prefill worker {host}:{port}: {header.get('message')}")
        if header.get("op") != "kv" or header.get("room") != room:
            raise TransferError(f"unexpected answer to the pull of room {room}: {header.get('op')!r}")
        return _payload_from(header, arrays)


class _InProcessListener(Listener):
    def __init__(self, hub: dict, port: int, on_pull: PullHandler):
        with _HUB_LOCK:
            if port == 0:
                port = max([40000, *hub]) + 1
            if port in hub:
                raise OSError(f"in-process KV listener port {port} is taken")
            hub[port] = on_pull
        self._hub, self.port = hub, port

    def close(self) -> None:
        with _HUB_LOCK:
            self._hub.pop(self.port, None)


_HUB: dict[int, PullHandler] = {}
_HUB_LOCK = threading.Lock()


class InProcessTransport(Transport):
    """Both roles in one process: the payload's arrays are handed over as they are (no copy, no socket).
    The host part of (host, port) is ignored: ports name listeners of this process."""

    name = "inprocess"

    def listen(self, port: int, on_pull: PullHandler) -> Listener:
        return _InProcessListener(_HUB, port, on_pull)

    def pull(self, host: str, port: int, room: int, timeout_s: float) -> KVPayload:
        with _HUB_LOCK:
            on_pull = _HUB.get(port)
        if on_pull is None:
            raise TransferError(f"no in-process prefill worker listens on port {port}")
        return on_pull(int(room), time.monotonic() + timeout_s)


def make_transport(name: str, timeout_s: float = 30.0) -> Transport:
    if name == "tcp":
        return TcpTransport(timeout_s)
    if name == "inprocess":
        return InProcessTransport()
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")


__all__ = ["KVPayload", "Listener", "TRANSPORTS", "TcpTransport", "InProcessTransport", "TransferError", "Transport",
           "make_transport", "read_frame", "send_frame"]
