"""kvtier: the CPU/GPU tiered KV cache, from Python.

- kvtier.local (imported here): the data path in this process over libkvtier's C API —
  Device, Sequence, Batch, the working-set views an engine's attention reads, statistics —
  with tensors in and out by DLPack (torch, numpy, CuPy), no compiled module and no torch ABI.
- kvtier.client: the gRPC client of kvtierd (sessions whose retrieval runs in the daemon);
  it needs grpcio and the generated protocol messages (kvtier.v1), present in a build tree.
"""

from kvtier.local import (
    Batch,
    Device,
    Error,
    LocalGeometry,
    Sequence,
    SequenceOptions,
    WorkingSetView,
)

__all__ = [
    "Batch",
    "Device",
    "Error",
    "LocalGeometry",
    "Sequence",
    "SequenceOptions",
    "WorkingSetView",
]

try:  # the gRPC client, where grpcio and the generated messages are installed
    from kvtier.client import (  # noqa: F401
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

    __all__ += [
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
except ImportError:
    pass
