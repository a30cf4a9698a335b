"""Values of the store: named tensors plus a small JSON header, as bytes (no pickle).

Layout of one value:

    b"VCKV" | version: u8 | header length: u32 LE | header: UTF-8 JSON | tensor bytes

The header is `{"meta": {...}, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}]}`;
offsets count from the start of the tensor bytes and are 64-byte aligned. Tensors are stored
contiguous, in CPU byte order (little endian on every supported machine).

Two kinds of chunk sit on top (`meta["kind"]`):
- "full": the exact KV of one chunk, tensors "k" and "v", each [layers, Hkv, n, D];
  meta: start, length.
- "compressed": a `CompressedChunk`; meta: compressor (its spec), start, length.
- "selection": moves of a drafter's kept set (`vericache.select.SelectionDelta`, compact
  form: int8 k, v with exponents "ke", "ve" at 8 bits), tensors "<i>.<name>" for the i-th
  delta; meta: count.
"""

from __future__ import annotations

import json
import struct
import warnings
from typing import Any

import torch

from vericache.compress.base import CompressedChunk, KVSpan
from vericache.errors import InvalidArgument
from vericache.select.base import SelectionDelta

MAGIC = b"VCKV"
VERSION = 1
_ALIGN = 64
_PREFIX = struct.Struct("<4sBI")

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def encode(tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> bytes:
    """Serialize named tensors (any device; copied to CPU) and JSON-able `meta` to bytes."""
    entries, flat, offset, end = [], [], 0, 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise InvalidArgument(f"tensor {name!r}: dtype {t.dtype} is not storable", "tensors")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        entries.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "offset": offset, "nbytes": raw.numel()})
        flat.append((offset, raw))
        end = offset + raw.numel()
        offset = _aligned(end)
    try:
        header = json.dumps({"meta": meta or {}, "tensors": entries},
                            separators=(",", ":")).encode()
    except TypeError as e:
        raise InvalidArgument(f"meta is not JSON-serializable: {e}", param="meta") from e
    head_len = _aligned(_PREFIX.size + len(header)) - _PREFIX.size
    buf = bytearray(_PREFIX.size + head_len + end)
    _PREFIX.pack_into(buf, 0, MAGIC, VERSION, head_len)
    buf[_PREFIX.size:_PREFIX.size + len(header)] = header
    body = _PREFIX.size + head_len
    if end:
        out = torch.frombuffer(buf, dtype=torch.uint8)
        for off, raw in flat:
            out[body + off: body + off + raw.numel()].copy_(raw)
    return bytes(buf)


def decode(data: bytes | bytearray | memoryview,
           borrow: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The named tensors (CPU, owning their memory) and meta of a value made by `encode`.
    `borrow`: the tensors are read-only views of `data` instead (no copy; the caller copies
    what it keeps and writes none of them)."""
    mv = memoryview(data).cast("B")
    if len(mv) < _PREFIX.size:
        raise InvalidArgument("value too short to be a VeriCache chunk", param="value")
    magic, version, head_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION:
        raise InvalidArgument(f"not a VeriCache chunk (magic {magic!r}, version {version})",
                              param="value")
    body = _PREFIX.size + head_len
    try:
        header = json.loads(bytes(mv[_PREFIX.size:body]).rstrip(b"\0"))
    except ValueError as e:
        raise InvalidArgument(f"corrupt chunk header: {e}", param="value") from e
    tensors = {}
    for e in header["tensors"]:
        start, n = body + e["offset"], e["nbytes"]
        if e["dtype"] not in _DTYPES or start + n > len(mv):
            raise InvalidArgument(f"corrupt chunk: tensor {e['name']!r} out of bounds or of "
                                  f"unknown dtype", param="value")
        dtype = _DTYPES[e["dtype"]]
        if n == 0:
            tensors[e["name"]] = torch.empty(e["shape"], dtype=dtype)
            continue
        if borrow:
            with warnings.catch_warnings():  # read-only memory: the caller only reads it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(mv[start:start + n], dtype=torch.uint8)
        else:
            raw = torch.frombuffer(bytearray(mv[start:start + n]), dtype=torch.uint8)
        tensors[e["name"]] = raw.view(dtype).reshape(e["shape"])
    return tensors, header["meta"]


def encode_chunk(chunk: CompressedChunk) -> bytes:
    """A `CompressedChunk` as bytes."""
    meta = {"kind": "compressed", "compressor": chunk.compressor, "start": chunk.start,
            "length": chunk.length}
    return encode(chunk.tensors, meta)


def decode_chunk(data: bytes | bytearray | memoryview) -> CompressedChunk:
    """The `CompressedChunk` stored by `encode_chunk`."""
    tensors, meta = decode(data)
    _expect_kind(meta, "compressed")
    return CompressedChunk(compressor=meta["compressor"], start=meta["start"],
                           length=meta["length"], tensors=tensors)


def encode_full(k: torch.Tensor, v: torch.Tensor, start: int = 0) -> bytes:
    """The exact KV of one chunk as bytes. k, v: [layers, Hkv, n, D], same shape and dtype."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise InvalidArgument(f"full chunk needs k, v of one shape [L, Hkv, n, D] and dtype; got "
                              f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}",
                              param="kv")
    return encode({"k": k, "v": v}, {"kind": "full", "start": start, "length": k.shape[2]})


def decode_full(data: bytes | bytearray | memoryview, borrow: bool = False) -> KVSpan:
    """The exact KV stored by `encode_full`, as a `KVSpan` (k, v, start); `borrow` as for
    `decode`."""
    tensors, meta = decode(data, borrow)
    _expect_kind(meta, "full")
    return KVSpan(k=tensors["k"], v=tensors["v"], start=meta["start"])


def encode_deltas(deltas: list[SelectionDelta]) -> bytes:
    """`SelectionDelta`s, in order, as bytes (only their real entries)."""
    tensors = {f"{i}.{name}": t for i, d in enumerate(deltas) for name, t in d.compact().items()}
    return encode(tensors, {"kind": "selection", "count": len(deltas)})


def decode_deltas(data: bytes | bytearray | memoryview) -> list[SelectionDelta]:
    """The `SelectionDelta`s stored by `encode_deltas`."""
    tensors, meta = decode(data)
    _expect_kind(meta, "selection")
    names = ("row", "slot", "pos", "k", "v", "shape")
    try:
        return [SelectionDelta.from_compact({**{n: tensors[f"{i}.{n}"] for n in names},
                                             **{n: tensors[f"{i}.{n}"] for n in ("ke", "ve")
                                                if f"{i}.{n}" in tensors}})
                for i in range(int(meta["count"]))]
    except (KeyError, ValueError, RuntimeError) as e:
        raise InvalidArgument(f"malformed selection delta: {e}", param="value") from None


def _expect_kind(meta: dict[str, Any], kind: str) -> None:
    if meta.get("kind") != kind:
        raise InvalidArgument(f"expected a {kind} chunk, got kind {meta.get('kind')!r}",
                              param="value")


def probs_to_bytes(q: torch.Tensor | None) -> bytes:
    """Draft distributions [k, V] float32 -> raw bytes for a Draft or Verify message (empty
    for greedy)."""
    return b"" if q is None else q.float().contiguous().numpy().tobytes()


def probs_from_bytes(data: bytes, k: int, vocab_size: int) -> torch.Tensor | None:
    """The inverse of `probs_to_bytes`; a length that is not k x V float32s is InvalidArgument."""
    if not data:
        return None
    if len(data) != 4 * k * vocab_size:
        raise InvalidArgument(f"draft_probs holds {len(data)} bytes, expected {4 * k * vocab_size}",
                              "draft_probs")
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(k, vocab_size)
