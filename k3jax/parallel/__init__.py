"""Parallel strategies of the K3 model over device meshes, built with `jax.shard_map` (see docs/parallelism.md).

    tep          TEP baseline: attention heads and experts split; all-reduces after attention, shared and
                 routed experts (k3jax/parallel/tep.py)
    dep          DEP: attention data parallel, experts expert-parallel, deduplicated all-to-all
                 dispatch/combine (k3jax/parallel/dep.py)
    tp_subgroup  DEP with TP subgroups of T ranks: all-gather -> column GEMM -> all-to-all back to the token
                 owner (shared experts in the model; `column_parallel` for projections)
    dcp          decode context parallel: MLA pages split over ranks, partial attention + log-sum-exp merge
    dwdp         DWDP: experts sharded for storage only; SPMD (next layer's shards all-gathered early,
                 double-buffered) and independent (one program per device, peer shards copied into two
                 alternating buffers, no collective)
    comm         communication accounting parsed from the compiled HLO (k3jax/parallel/comm.py)

Every strategy is numerically equal to the single-device model (tests/parallel/); `k3jax.plan` sizes them.
"""
