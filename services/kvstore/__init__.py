"""The kvstore service: a `ChunkStore` (memory, Redis or LMCache behind it) over gRPC.

Run it with `python -m services.kvstore --port 50051 --backend redis://127.0.0.1:6379/0`;
reach it with `vericache.store.open_store("grpc://HOST:PORT")`.
"""
