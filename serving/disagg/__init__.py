"""Disaggregated prefill/decode: worker roles, KV transfer, the router and one-command deployments.

    roles.py      PrefillHandoff / DecodeIntake: what an Engine with role prefill / decode adds
    transfer.py   KVPayload and its transports (tcp between processes, inprocess within one)
    router.py     `k3jax router`: OpenAI HTTP front, least-work prefill + least-load decode over gRPC
    deploy.py     DeploymentConfig (YAML) and the launcher behind `k3jax serve --deployment`
"""
