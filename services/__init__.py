"""Thin gRPC/HTTP processes over the core library (`vericache`); `proto/` is their contract.

No algorithm lives here: servicers translate messages to core calls and back.
"""
