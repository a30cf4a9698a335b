"""The verifier service: full KV per request, prefill and batched verification over gRPC."""
