"""Engine configuration: one frozen dataclass; CLI defaults are read from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    """How one worker serves a model. Sizes in pages/slots; `None` means "size from free memory"."""

    model: str = "k3-tiny"
    weights: str | None = None  # orbax checkpoint or HF directory; None = random init (seed)
    seed: int = 0
    backend: str = "reference"
    page_size: int = 16
    num_pages: int | None = None
    num_slots: int | None = None  # KDA rows: running requests + checkpoints
    max_running: int = 64  # decode batch limit
    max_prefill_tokens: int = 512  # token budget of the prefill part of one step
    # Requests prefilled in one step; None = max_running. A prefill step is padded to (rows bucket x the longest
    # row's tokens bucket), so on a large model a small cap (1-4) keeps the padded shape near the token budget
    # (64 rows x 1024 tokens would pad ~64x and, on the reference path, hold 64 rows of attention scores).
    max_prefill_rows: int | None = None
    max_model_len: int = 4096
    cache_memory_fraction: float = 0.5  # of free device memory, when sizing pools automatically
    preemption: str = "recompute"  # "recompute": drop private state, recompute from a prefix hit; "swap": park it on the host
    prefix_cache: bool = True
    host_cache_gb: float = 0.0  # host L2 tier for evicted pages + checkpoints; 0 = off
    cache_pool: str | None = None  # shared cache pool below the host L2: "pool://host:port" (serving.cache.pool_server) or "mooncake://..."
    session_ttl_s: float = 600.0  # a waiting agent session counts as stale after this
    bucket_growth: int = 2  # shape buckets (rows, tokens, pages) grow by this factor; larger = fewer compiles
    # Explicit shape buckets instead of powers of bucket_growth, as comma-separated sizes ("4,16,64"); the limit
    # (max_running / max_prefill_tokens / max_pages_per_request) is added when the list ends below it. Every
    # (rows, tokens, pages) bucket is one jit program (~30-45 s to compile for k3-small on an H200): a large
    # model serves from a handful of buckets, e.g. token_buckets "1024" and page_buckets equal to the limit.
    row_buckets: str | None = None
    token_buckets: str | None = None
    page_buckets: str | None = None
    # Overlap scheduling: a decode-only step is dispatched before the previous one's tokens are read back (the
    # host's per-step work hides behind the device's); outputs arrive one step() later. Not with speculative_k.
    overlap_schedule: bool = True
    speculative_k: int = 0  # draft tokens per decode step (EAGLE-3 drafter); 0 = off
    drafter: str | None = None  # drafter checkpoint (k3jax.drafter.save_drafter); or Engine(drafter=(dcfg, params))
    spec_fixed_accepted: int | None = None  # BENCHMARK ONLY: accept exactly this many drafts (outputs are not the model's)
    # Disaggregated prefill/decode (serving.disagg): "both" = colocated (today's behaviour)
    role: str = "both"  # "prefill": prompt + first token, then hand the KV to a decode worker; "decode": pull it, decode
    bootstrap_port: int | None = None  # prefill: where decode workers pull KV (SGLang bootstrap port); 0/None = any free
    disagg_transport: str = "tcp"  # "tcp" between processes, "inprocess" when both roles share one process
    handoff_max_held: int = 16  # prefill: finished prompts held for their decode partner before admission stops
    handoff_timeout_s: float = 60.0  # prefill: a held request nobody pulls is freed after this
    transfer_timeout_s: float = 600.0  # decode: a pull not completed by then (prefill queue + compute + copy) fails its request
    pd_admission: str = "independent"  # prefill admission: "independent", or "decode_first" (wait for the partner)
    store_write_through: bool = False  # copy published pages + checkpoints to the store at once (always on for P/D roles)

    def __post_init__(self) -> None:
        problems = []
        for name in ("page_size", "max_running", "max_prefill_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.max_prefill_rows is not None and not 1 <= self.max_prefill_rows <= self.max_running:
            problems.append("max_prefill_rows must be in [1, max_running] or None")
        for name in ("num_pages", "num_slots"):
            if getattr(self, name) is not None and getattr(self, name) < 2:
                problems.append(f"{name} must be >= 2 or None")
        if self.bucket_growth < 2:
            problems.append("bucket_growth must be >= 2")
        if self.preemption not in ("recompute", "swap"):
            problems.append(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if not 0 <= self.speculative_k <= 8:
            problems.append("speculative_k must be in [0, 8]")
        if self.spec_fixed_accepted is not None and not 0 <= self.spec_fixed_accepted <= self.speculative_k:
            problems.append("spec_fixed_accepted must be in [0, speculative_k] (and is a benchmark-only mode)")
        if not 0 < self.cache_memory_fraction <= 0.95:
            problems.append("cache_memory_fraction must be in (0, 0.95]")
        if self.host_cache_gb < 0:
            problems.append("host_cache_gb must be >= 0")
        if self.role not in ROLES:
            problems.append(f"role must be one of {ROLES}, got {self.role!r}")
        if self.disagg_transport not in ("tcp", "inprocess"):
            problems.append(f"disagg_transport must be 'tcp' or 'inprocess', got {self.disagg_transport!r}")
        if self.pd_admission not in ("independent", "decode_first"):
            problems.append(f"pd_admission must be 'independent' or 'decode_first', got {self.pd_admission!r}")
        if self.bootstrap_port is not None and not 0 <= self.bootstrap_port <= 65535:
            problems.append(f"bootstrap_port must be in [0, 65535], got {self.bootstrap_port}")
        if self.handoff_max_held < 1:
            problems.append("handoff_max_held must be >= 1")
        if not (self.handoff_timeout_s > 0 and self.transfer_timeout_s > 0):
            problems.append("handoff_timeout_s and transfer_timeout_s must be > 0")
        if self.max_prefill_tokens < self.page_size:
            problems.append("max_prefill_tokens must be at least one page")
        for name, limit in (("row_buckets", self.max_running), ("token_buckets", self.max_prefill_tokens),
                            ("page_buckets", self.max_pages_per_request)):
            try:
                explicit_buckets(getattr(self, name), limit)
            except ValueError as e:
                problems.append(f"{name}: {e}")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def prefill_rows_limit(self) -> int:
        """Requests one step may prefill: max_prefill_rows, or max_running when unset."""
        return self.max_prefill_rows or self.max_running

    @property
    def max_pages_per_request(self) -> int:
        """Pages a request can touch: its tokens plus the k positions a verify step writes past them."""
        return -(-(self.max_model_len + self.speculative_k) // self.page_size)


def explicit_buckets(spec: str | None, limit: int) -> tuple[int, ...] | None:
    """Parse a comma-separated bucket list ("4,16,64") into sizes ending at `limit` (added when the list ends
    below it); None for None. ValueError unless the sizes are increasing positive ints <= limit."""
    if spec is None:
        return None
    try:
        sizes = [int(x) for x in str(spec).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated positive ints, got {spec!r}") from None
    if not sizes or sizes[0] < 1 or any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"expected increasing positive sizes, got {spec!r}")
    if sizes[-1] > limit:
        raise ValueError(f"{sizes[-1]} exceeds the limit {limit}")
    return tuple(sizes) if sizes[-1] == limit else (*sizes, limit)
