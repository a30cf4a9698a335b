"""The drafter service: lossy KV per request, batched drafting over gRPC."""
