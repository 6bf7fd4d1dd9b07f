"""A small registry of compute backends for the model's hot ops.

Each op (e.g. "kda_chunked", "mla_paged_attention", "moe_experts") has a plain-JAX "reference"
implementation next to the model code. Pallas kernels register the same op under "pallas" (compiled for
the GPU) and "interpret" (Pallas interpret mode, for CPU CI). The model asks for an op by name and the
backend chosen by the caller (a static argument of every step function); a backend that lacks an op
falls back to the reference, so kernels can land one at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

BACKENDS = ("reference", "pallas", "interpret")
_REGISTRY: dict[tuple[str, str], Callable] = {}
_TWINS: dict[str, Callable] = {}


def register(op: str, backend_name: str) -> Callable[[Callable], Callable]:
    """Decorator: registers `fn` as the implementation of `op` for `backend_name`."""
    if backend_name not in BACKENDS:
        raise ValueError(f"unknown backend {backend_name!r}; expected one of {BACKENDS}")

    def wrap(fn: Callable) -> Callable:
        key = (op, backend_name)
        if key in _REGISTRY and _REGISTRY[key] is not fn:
            raise ValueError(f"{op!r} already has a {backend_name!r} implementation")
        _REGISTRY[key] = fn
        return fn

    return wrap


def unregister(op: str, backend_name: str) -> None:
    """Removes `backend_name`'s own implementation of `op` (if any): that backend then falls back to the reference.
    For an op whose kernel is opt-in (k3jax.layers.use_dense_kernel), so `implemented` says what runs. Jitted steps
    keyed on the backend's name keep code traced before the change (the caller clears jax's caches)."""
    if backend_name not in BACKENDS:
        raise ValueError(f"unknown backend {backend_name!r}; expected one of {BACKENDS}")
    _REGISTRY.pop((op, backend_name), None)


def get(op: str, backend_name: str = "reference") -> Callable:
    """The implementation of `op` for `backend_name`, or the reference if that backend lacks it."""
    if backend_name not in BACKENDS:
        raise ValueError(f"unknown backend {backend_name!r}; expected one of {BACKENDS}")
    fn = _REGISTRY.get((op, backend_name)) or _REGISTRY.get((op, "reference"))
    if fn is None:
        raise KeyError(f"no implementation registered for op {op!r}")
    return fn


def register_twin(op: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn` is the plain-JAX twin of `op` (same arguments and results), for an op that has kernel
    implementations but no "reference" registration of its own (the fused KDA ops: registering them under
    "reference" would switch the reference model onto the fused path). Checks compare kernels with it."""

    def wrap(fn: Callable) -> Callable:
        if op in _TWINS and _TWINS[op] is not fn:
            raise ValueError(f"{op!r} already has a twin")
        _TWINS[op] = fn
        return fn

    return wrap


def twin(op: str) -> Callable:
    """What a kernel implementation of `op` is checked against: its registered twin, else its reference."""
    fn = _TWINS.get(op) or _REGISTRY.get((op, "reference"))
    if fn is None:
        raise KeyError(f"op {op!r} has neither a twin nor a reference implementation")
    return fn


def implemented(op: str) -> list[str]:
    """Backends that have their own implementation of `op`."""
    return [b for (o, b) in _REGISTRY if o == op]


@contextlib.contextmanager
def restricted(backend_name: str, ops: tuple[str, ...]) -> Iterator[None]:
    """Within the block, `backend_name` keeps its own implementations of `ops` only: every other op falls back
    to the reference. For bisecting a backend op by op (which kernel moves a model's output). Jitted steps
    keyed on the backend's name would reuse code traced outside the block, so the caller clears jax's caches
    on entry and exit (benchmarks/model_forward.py does)."""
    if backend_name not in BACKENDS:
        raise ValueError(f"unknown backend {backend_name!r}; expected one of {BACKENDS}")
    missing = [op for op in ops if (op, backend_name) not in _REGISTRY]
    if missing:
        raise ValueError(f"backend {backend_name!r} has no implementation of {missing}; it implements "
                         f"{sorted(o for (o, b) in _REGISTRY if b == backend_name)}")
    hidden = {key: fn for key, fn in _REGISTRY.items() if key[1] == backend_name and key[0] not in ops}
    for key in hidden:
        del _REGISTRY[key]
    try:
        yield
    finally:
        _REGISTRY.update(hidden)
