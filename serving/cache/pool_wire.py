"""The shared cache pool's wire format: framing, limits and descriptor checks, shared by the server
(pool_server.py), its client (pool_client.py), the Mooncake backend's self-describing blobs, and the KV
transfer between prefill and decode workers (serving/disagg/transfer.py: `recv_exact`, `sendmsg_all`,
`DTYPE_ITEMSIZE`). Standard library + msgpack only: pool_server.py runs as a plain script.

    frame   = MAGIC (4 bytes b"K3P1") | header_len u32 | payload_len u64   (network order, 16 bytes)
              | header (msgpack map, header_len bytes) | payload (payload_len raw bytes)
    blob    = {"arrays": [[name, dtype, shape, nbytes], ...]}: names "latents" then optionally "kda",
              "conv" (both or neither); its bytes are the arrays' C-order bytes concatenated in that order

Never pickle: every length is checked against a limit before anything is allocated, every dtype against
an allow-list, every shape for non-negative ints.
"""

from __future__ import annotations

import math
import socket
import struct

import msgpack

MAGIC = b"K3P1"
FRAME = struct.Struct("!4sIQ")
MAX_HEADER_BYTES = 8 << 20  # 65536 keys of 64 hex chars plus descriptors fit several times over
MAX_KEYS = 65536
MAX_KEY_CHARS = 256
MAX_NDIM = 8
DEFAULT_MAX_REQUEST_BYTES = 1 << 30

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


# --- framing ---------------------------------------------------------------------------------------
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


def sendmsg_all(sock: socket.socket, buffers) -> int:
    """Send every buffer in order, gathered into as few syscalls as the kernel allows (sendmsg with up to
    512 buffers each): a hundred small pages are one write, not a hundred. Returns the bytes sent."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(p) for p in pending)
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
    return total


def send_frame(sock: socket.socket, header: dict, buffers) -> None:
    """Frame prefix + header + the payload buffers, in one gathered send."""
    sendmsg_all(sock, [pack_frame(header, sum(len(b) for b in buffers)), *buffers])
