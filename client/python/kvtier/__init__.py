"""kvtier: a Python client for kvtierd, the CPU/GPU tiered KV-cache service.

See kvtier.client for the API; the generated protocol messages are in kvtier.v1.kvtier_pb2.
"""

from kvtier.client import (
    PROTOCOL_VERSION,
    Chunk,
    Client,
    FetchedPage,
    Geometry,
    KvtierError,
    OffloadResult,
    Session,
    StepResult,
    pack_fp16,
    unpack_fp16,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Chunk",
    "Client",
    "FetchedPage",
    "Geometry",
    "KvtierError",
    "OffloadResult",
    "Session",
    "StepResult",
    "pack_fp16",
    "unpack_fp16",
]
