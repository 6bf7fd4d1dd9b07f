"""The serving interfaces: OpenAI HTTP (http), SGLang-scheduler gRPC for the SMG gateway (grpc_server) with
KV events (kv_events), Prometheus metrics (metrics), tokenizers (tokenizer) and the `k3jax serve`
process (server). See ../../shared/design/interfaces.md for the protocols."""
