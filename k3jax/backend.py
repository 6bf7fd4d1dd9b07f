"""A small registry of compute backends for the model's hot ops.

Each op (e.g. "kda_chunked", "mla_paged_attention", "moe_experts") has a plain-JAX "reference"
implementation next to the model code. Pallas kernels register the same op under "pallas" (compiled for
the GPU) and "interpret" (Pallas interpret mode, for CPU CI). The model asks for an op by name and the
backend chosen by the caller (a static argument of every step function); a backend that lacks an op
falls back to the reference, so kernels can land one at a time.
"""

from __future__ import annotations

from collections.abc import Callable

BACKENDS = ("reference", "pallas", "interpret")
_REGISTRY: dict[tuple[str, str], Callable] = {}


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


def get(op: str, backend_name: str = "reference") -> Callable:
    """The implementation of `op` for `backend_name`, or the reference if that backend lacks it."""
    if backend_name not in BACKENDS:
        raise ValueError(f"unknown backend {backend_name!r}; expected one of {BACKENDS}")
    fn = _REGISTRY.get((op, backend_name)) or _REGISTRY.get((op, "reference"))
    if fn is None:
        raise KeyError(f"no implementation registered for op {op!r}")
    return fn


def implemented(op: str) -> list[str]:
    """Backends that have their own implementation of `op`."""
    return [b for (o, b) in _REGISTRY if o == op]
