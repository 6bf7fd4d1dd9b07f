"""Parallel strategies of the K3 model over a 1-D device mesh, built with `jax.shard_map`.

    tep   TEP baseline: attention heads and experts split; all-reduces after attention, shared and
          routed experts (k3jax/parallel/tep.py)
    dep   DEP: attention data parallel, experts expert-parallel, deduplicated all-to-all
          dispatch/combine (k3jax/parallel/dep.py)
    comm  communication accounting parsed from the compiled HLO (k3jax/parallel/comm.py)

Every strategy is numerically equal to the single-device model (tests/parallel/).
"""
