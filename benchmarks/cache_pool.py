"""Shared cache pool throughput and latency on loopback (CPU): a 100-page chain through PoolStore (the
embedded pool server, in its own process) and MooncakeStore (mooncake_master + a segment owner process,
TCP, P2PHANDSHAKE), with the in-process HostStore and the machine's limits as references.

    python benchmarks/cache_pool.py --out docs/results/cache_pool_cpu.json
    python benchmarks/cache_pool.py --pages 10 --iters 2 --stores pool      # quick check

A page is K3-shaped by default: MLA latents [24 layers, page_size 16, 576] bf16 (442 KiB); `--ckpt-mib`
adds a KDA checkpoint of that size to the chain's last page (K3's real one is hundreds of MiB).
Per store and iteration, a fresh chain (new keys, fresh random bytes):
    put_many(chain)          one batched write of the whole history (what a prefill worker publishes)
    contains_prefix(chain)   the admission-time lookup: one round trip
    get_many(chain)          one batched read of the whole history (a continuation on another worker)
    get(key) x pages         page-at-a-time reads (what KVManager._restore_from_store does today)
reported as median / max over iterations (seconds, and GB/s of blob bytes for the batched ops).

Limits measured in the same run: host memcpy bandwidth (numpy copy of the chain's bytes) and raw
loopback TCP bandwidth (the chain's bytes through one socket to a reader thread, no framing), the
ceilings for an in-process store and for any TCP pool respectively.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from serving.cache.hashing import prefix_hashes  # noqa: E402
from serving.cache.host_tier import HostStore  # noqa: E402
from serving.cache.pool_client import PoolStore  # noqa: E402
from serving.cache.store import PageBlob  # noqa: E402
from serving.ports import free_port  # noqa: E402

_MIB = 1 << 20
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=100, help="pages in the chain")
    p.add_argument("--layers", type=int, default=24, help="MLA layers per page blob")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--width", type=int, default=576, help="latent width (bf16)")
    p.add_argument("--ckpt-mib", type=float, default=0.0, help="KDA checkpoint on the last page, MiB (0: none)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per store (after 1 untimed)")
    p.add_argument("--stores", default="host,pool,mooncake", help="comma list of host, pool, mooncake")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    for name in ("pages", "layers", "page_size", "width", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    unknown = set(args.stores.split(",")) - {"host", "pool", "mooncake"}
    if unknown:
        p.error(f"unknown stores {sorted(unknown)}")
    return args


def make_chain(rng: np.random.Generator, args) -> tuple[list[str], list[PageBlob]]:
    tokens = rng.integers(0, 160_000, args.pages * args.page_size).tolist()
    keys = prefix_hashes(tokens, args.page_size)
    blobs = []
    for i in range(args.pages):
        latents = rng.integers(0, 1 << 16, (args.layers, args.page_size, args.width), dtype=np.uint16)
        if i == args.pages - 1 and args.ckpt_mib > 0:
            n = int(args.ckpt_mib * _MIB) // 4
            blobs.append(PageBlob(latents, kda=rng.standard_normal(n, dtype=np.float32).reshape(1, -1),
                                  conv=rng.standard_normal(64, dtype=np.float32).reshape(1, -1)))
        else:
            blobs.append(PageBlob(latents))
    return keys, blobs


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_store(store, args, rng) -> dict:
    samples = {"put_many_s": [], "contains_prefix_s": [], "get_many_s": [], "get_each_s": []}
    chain_bytes = 0
    for it in range(args.iters + 1):
        keys, blobs = make_chain(rng, args)
        chain_bytes = sum(b.nbytes for b in blobs)
        put = getattr(store, "put_many", None) or (lambda items: [store.put(k, b) for k, b in items])
        get_many = getattr(store, "get_many", None) or (lambda ks: [store.get(k) for k in ks])
        t_put, kept = timed(lambda: put(list(zip(keys, blobs))))
        t_contains, n = timed(lambda: store.contains_prefix(keys))
        t_get, got = timed(lambda: get_many(keys))
        t_each, each = timed(lambda: [store.get(k) for k in keys])
        if not all(kept) or n != len(keys):
            raise RuntimeError(f"{type(store).__name__}: kept {sum(kept)}/{len(keys)}, contains_prefix {n}")
        for g, e, b in ((got[0], each[0], blobs[0]), (got[-1], each[-1], blobs[-1])):  # spot-check bytes
            if g is None or e is None or g.latents.tobytes() != b.latents.tobytes() or e.latents.tobytes() != b.latents.tobytes():
                raise RuntimeError(f"{type(store).__name__}: wrong bytes back")
        if it == 0:
            continue  # untimed: connections, first allocations
        for name, t in (("put_many_s", t_put), ("contains_prefix_s", t_contains), ("get_many_s", t_get),
                        ("get_each_s", t_each)):
            samples[name].append(t)
    out = {"chain_bytes": chain_bytes, "samples": samples}
    for name, values in samples.items():
        out[name] = {"median": statistics.median(values), "max": max(values)}
    out["put_many_gbps"] = chain_bytes / out["put_many_s"]["median"] / 1e9
    out["get_many_gbps"] = chain_bytes / out["get_many_s"]["median"] / 1e9
    out["get_each_gbps"] = chain_bytes / out["get_each_s"]["median"] / 1e9
    out["get_one_page_ms"] = out["get_each_s"]["median"] / args.pages * 1e3
    return out


def memcpy_gbps(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t, _ = timed(lambda: np.copyto(dst, src))
        times.append(t)
    return nbytes / statistics.median(times) / 1e9


def loopback_tcp_gbps(nbytes: int) -> float:
    """The bytes through one loopback TCP connection into a reader thread's buffer (recv_into)."""
    payload = memoryview(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    times = []

    def reader(conn, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            got += conn.recv_into(view[got:], n - got)
        conn.sendall(b"x")

    with socket.create_connection(("127.0.0.1", port)) as sender:
        conn, _ = listener.accept()
        for _ in range(5):
            th = threading.Thread(target=reader, args=(conn, nbytes))
            th.start()
            t, _ = timed(lambda: (sender.sendall(payload), sender.recv(1)))
            th.join()
            times.append(t)
        conn.close()
    listener.close()
    return nbytes / statistics.median(times) / 1e9


def start_pool_server(capacity_bytes: int):
    proc = subprocess.Popen([sys.executable, os.path.join(_ROOT, "serving", "cache", "pool_server.py"), "--port", "0",
                             "--capacity-gb", str(capacity_bytes / (1 << 30))], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    return proc, port


_OWNER = """
import sys, time
from serving.cache.mooncake_store import import_mooncake_store
s = import_mooncake_store()()
rc = s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "global_segment_size": int(sys.argv[2]),
              "local_buffer_size": 16 << 20, "protocol": "tcp", "master_server_addr": sys.argv[1]})
print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
time.sleep(3600)
"""


def start_mooncake(segment_bytes: int):
    """mooncake_master + a separate process that contributes the memory segment (so the benchmark's
    client, which contributes none, moves every byte over TCP like a remote worker would)."""
    from serving.cache.mooncake_store import mooncake_env, mooncake_master_command

    cmd = mooncake_master_command()
    if cmd is None:
        raise RuntimeError("mooncake not installed (bash scripts/extras/mooncake.sh)")
    port = free_port()
    master = subprocess.Popen(cmd + ["-rpc_address=127.0.0.1", f"-rpc_port={port}", "-metrics_host=127.0.0.1",
                                     f"-metrics_port={free_port()}"], env=mooncake_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    env = dict(os.environ, PYTHONPATH=_ROOT, GLOG_minloglevel="2")
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, f"127.0.0.1:{port}", str(segment_bytes)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if owner.stdout.readline().strip() != "ready":
        raise RuntimeError("mooncake segment owner did not start")
    return master, owner, port


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    probe_keys, probe_blobs = make_chain(np.random.default_rng(1), args)
    chain_bytes = sum(b.nbytes for b in probe_blobs)
    capacity = 4 * chain_bytes + 64 * _MIB  # every iteration's chain fits: no eviction inside a run
    result = {
        "benchmark": "cache_pool", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "chain_bytes": chain_bytes, "page_bytes": probe_blobs[0].nbytes,
        "limits": {"memcpy_gbps": memcpy_gbps(chain_bytes), "loopback_tcp_gbps": loopback_tcp_gbps(chain_bytes)},
        "stores": {},
    }
    stores = args.stores.split(",")
    if "host" in stores:
        result["stores"]["host (in-process HostStore)"] = bench_store(HostStore(capacity_bytes=capacity * 2), args, rng)
    if "pool" in stores:
        proc, port = start_pool_server(capacity * 2)
        try:
            store = PoolStore("127.0.0.1", port, op_timeout_s=60)
            result["stores"]["pool (pool_server process, TCP)"] = bench_store(store, args, rng)
            store.close()
        finally:
            proc.kill()
    if "mooncake" in stores:
        os.environ.setdefault("GLOG_minloglevel", "2")  # quiet the client's per-call INFO lines
        from serving.cache.mooncake_store import MooncakeStore

        master, owner, port = start_mooncake(max(capacity * 2, 64 * _MIB))
        try:
            buffer = max(16 * _MIB, 2 * chain_bytes + 16 * _MIB)  # get_batch stages the whole chain here
            store = MooncakeStore(f"127.0.0.1:{port}", global_segment_bytes=0, local_buffer_bytes=buffer)
            result["stores"]["mooncake (segment in another process, TCP)"] = bench_store(store, args, rng)
            store.close()
        finally:
            owner.kill()
            master.kill()
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def print_table(result: dict) -> None:
    lim = result["limits"]
    print(f"chain: {result['config']['pages']} pages x {result['page_bytes'] / 1024:.0f} KiB = "
          f"{result['chain_bytes'] / _MIB:.1f} MiB; limits: memcpy {lim['memcpy_gbps']:.2f} GB/s, "
          f"loopback TCP {lim['loopback_tcp_gbps']:.2f} GB/s")
    print(f"{'store':<46} {'put_many':>10} {'GB/s':>6} {'contains':>9} {'get_many':>10} {'GB/s':>6} "
          f"{'get/page':>9} {'vs TCP':>7}")
    for name, r in result["stores"].items():
        print(f"{name:<46} {r['put_many_s']['median'] * 1e3:>8.1f}ms {r['put_many_gbps']:>6.2f} "
              f"{r['contains_prefix_s']['median'] * 1e3:>7.2f}ms {r['get_many_s']['median'] * 1e3:>8.1f}ms "
              f"{r['get_many_gbps']:>6.2f} {r['get_one_page_ms']:>7.2f}ms "
              f"{r['get_many_gbps'] / lim['loopback_tcp_gbps']:>7.2f}")


if __name__ == "__main__":
    main()
