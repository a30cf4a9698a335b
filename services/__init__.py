"""Thin gRPC/HTTP processes over the core library (`vericache`); `proto/` is their contract.

No algorithm lives here: servicers translate messages to core calls and back.
"""

import vericache  # noqa: F401,E402  (first: its allocator defaults precede any torch allocation)
