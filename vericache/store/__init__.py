"""The KV chunk store: one interface (`ChunkStore`), backends chosen by URL (`open_store`).

Keys come from `vericache.store.keys`, values from `vericache.store.codec` (imported on its
own: it needs torch, the store itself does not).
"""

from vericache.store.base import ChunkStore
from vericache.store.keys import chunk_keys, compressed_key, full_key, stored_key
from vericache.store.registry import open_store, register_store, store_schemes

__all__ = ["ChunkStore", "chunk_keys", "compressed_key", "full_key", "open_store",
           "register_store", "store_schemes", "stored_key"]
