"""A small Python client for kvtierd's gRPC control protocol (proto/kvtier/v1/kvtier.proto).

It speaks the GRPC transport: pages travel in Offload / Fetch messages and the daemon's CPU
Retriever selects and attends with Step. Local engines that want the shared-memory path use
libkvtier (include/kvtier/client.h) instead.

    with Client("unix:///run/kvtier/kvtierd.sock", tenant="a", token="...") as client:
        session = client.open_session(
            {"num_layers": 2, "num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64},
            budget_tokens=512)
        session.offload(0, k, v)              # NHD [n][Hkv][d] bytes in the session dtype
        result = session.step(0, q)           # q [Hq][d]
        pages = session.fetch(0, [0])         # HND [Hkv][2][p][d] per page
        session.close()

Every call carries the tenant (and token, when there is one) in its metadata and the
client's timeout as its deadline; every failure is a KvtierError with the gRPC status code
and the daemon's message. Client is thread-safe (gRPC channels are); a Session should be
used by one thread at a time.
"""

from __future__ import annotations

import dataclasses
import struct
import uuid
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import grpc

from kvtier import _health_pb2 as health_pb2
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

PROTOCOL_VERSION = 1  # include/kvtier/client.h kProtocolVersion

_DTYPES = {"fp16": pb.DTYPE_FP16, "bf16": pb.DTYPE_BF16, "fp32": pb.DTYPE_FP32}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
_MODES = {
    "speculative": pb.MODE_SPECULATIVE,
    "sync": pb.MODE_SYNC,
    "full": pb.MODE_FULL,
    "drop": pb.MODE_DROP,
}
_TRANSPORTS = {"shm": pb.TRANSPORT_SHM, "grpc": pb.TRANSPORT_GRPC}
# Speculative mode's correction triggers (RetrievalOptions.correction_trigger).
_CORRECTION_TRIGGERS = ("cosine", "mass")
# What a page is scored by (RetrievalOptions.summary).
_SUMMARIES = ("key-codes", "center-mad", "minmax")
# Room for an OffloadRequest's other fields when chunks are sized to the message limit.
_MESSAGE_OVERHEAD_BYTES = 4096


class KvtierError(Exception):
    """A failed call: the gRPC status code, the daemon's message and its trailing metadata
    (e.g. x-kvtier-steps-run, grpc-retry-pushback-ms)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, trailers: Optional[Mapping[str, str]] = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.trailers = dict(trailers or {})


def _error(e: grpc.RpcError) -> KvtierError:
    trailers = {}
    try:
        trailers = {k: v for k, v in (e.trailing_metadata() or ()) if isinstance(v, str)}
    except Exception:  # pylint: disable=broad-except  (not every RpcError has them)
        pass
    return KvtierError(e.code(), e.details() or "", trailers)


def pack_fp16(values: Iterable[float]) -> bytes:
    """Packs floats as little-endian IEEE half precision (the session dtype "fp16")."""
    values = list(values)
    return struct.pack(f"<{len(values)}e", *values)


def unpack_fp16(data: bytes) -> List[float]:
    """Unpacks little-endian IEEE half-precision bytes into floats."""
    if len(data) % 2:
        raise ValueError(f"fp16 data has {len(data)} bytes; expected an even count")
    return list(struct.unpack(f"<{len(data) // 2}e", data))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The model shape of a session (include/kvtier/geometry.h)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 32  # tokens per page
    dtype: str = "fp16"  # "fp16" | "bf16" | "fp32"

    @property
    def element_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V): [Hkv][d]."""
        return self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page, HND [Hkv][2][p][d]."""
        return 2 * self.page_size * self.token_bytes

    def to_proto(self) -> pb.Geometry:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        return pb.Geometry(
            num_layers=self.num_layers,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=_DTYPES[self.dtype],
        )

    @classmethod
    def from_proto(cls, g: pb.Geometry) -> "Geometry":
        return cls(
            num_layers=g.num_layers,
            num_q_heads=g.num_q_heads,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            page_size=g.page_size or 32,
            dtype=_DTYPE_NAMES.get(g.dtype, "fp16"),
        )


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One OffloadRequest: K and V, NHD [num_tokens][Hkv][d] in the session dtype."""

    k: bytes = dataclasses.field(repr=False)
    v: bytes = dataclasses.field(repr=False)
    num_tokens: int
    commit: bool = False


@dataclasses.dataclass(frozen=True)
class OffloadResult:
    committed_tokens: int  # in this stream, over all layers
    layer_tokens: List[int]  # per layer, the session's total after the stream


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one Step did (StepReply)."""

    layer: int
    num_tokens: int
    num_slots: int
    slot_table: List[int]  # [Hkv][num_slots]: logical page per slot, -1 empty
    output: bytes = dataclasses.field(repr=False)  # [Hq][d], session dtype (want_output)
    lse: List[float]  # [Hq]; empty without want_output
    corrected_heads: int
    step: int = 0  # the layer's count of steps run, this one included
    replayed: bool = False  # an earlier run's reply, sent again (nothing ran)

    def slots_of_head(self, kv_head: int) -> List[int]:
        """The slot table row of one KV head."""
        return self.slot_table[kv_head * self.num_slots : (kv_head + 1) * self.num_slots]


@dataclasses.dataclass(frozen=True)
class FetchedPage:
    layer: int
    page: int
    generation: int  # the commit stamp
    data: bytes = dataclasses.field(repr=False)  # HND [Hkv][2][p][d]


def _normalize_target(target: str) -> str:
    """A bare filesystem path means a Unix socket."""
    return "unix:" + target if target.startswith("/") else target


class Client:
    """A connection to kvtierd for one tenant."""

    def __init__(
        self,
        target: str,
        tenant: str = "default",
        token: str = "",
        timeout: float = 30.0,
        client_name: str = "kvtier-python",
    ) -> None:
        """`target`: "unix:///path/kvtierd.sock", a bare socket path, or "host:port".
        `timeout`: the deadline of every call, in seconds."""
        self.target = _normalize_target(target)
        self.tenant = tenant
        self.timeout = timeout
        self.client_name = client_name
        self._metadata = [("x-kvtier-tenant", tenant)]
        if token:
            self._metadata.append(("x-kvtier-token", token))
        # Fetch replies are as large as the daemon's max_message_bytes allows.
        self._channel = grpc.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", -1)]
        )
        self._stub = pb_grpc.KvTierStub(self._channel)
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        self._hello: Optional[pb.HelloReply] = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; sessions stay open in the daemon (reattach later)."""
        self._channel.close()

    def _call(
        self, method: Callable[..., Any], request: Any, timeout: Optional[float] = None, **kw: Any
    ) -> Any:
        try:
            return method(
                request,
                metadata=self._metadata,
                timeout=self.timeout if timeout is None else timeout,
                **kw,
            )
        except grpc.RpcError as e:
            raise _error(e) from None

    def health(
        self, service: str = "", wait_for_ready: bool = False, timeout: Optional[float] = None
    ) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... (empty `service`: the server as
        a whole). With `wait_for_ready`, waits for the daemon to come up (until `timeout`
        seconds, default the client's) instead of failing at once with UNAVAILABLE."""
        reply = self._call(
            self._health_check,
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout,
            wait_for_ready=wait_for_ready,
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def hello(self) -> pb.HelloReply:
        """Exchanges protocol versions; KvtierError FAILED_PRECONDITION when the daemon does
        not speak PROTOCOL_VERSION. The reply (limits, capabilities) is cached."""
        reply = self._call(
            self._stub.Hello,
            pb.HelloRequest(protocol_version=PROTOCOL_VERSION, client_name=self.client_name),
        )
        if not reply.min_protocol_version <= PROTOCOL_VERSION <= reply.protocol_version:
            raise KvtierError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the daemon speaks protocol versions {reply.min_protocol_version} to "
                f"{reply.protocol_version}; this client speaks {PROTOCOL_VERSION}",
            )
        self._hello = reply
        return reply

    def limits(self) -> pb.Limits:
        """The daemon's limits (from Hello, called once when needed)."""
        if self._hello is None:
            self.hello()
        assert self._hello is not None
        return self._hello.limits

    def open_session(
        self,
        geometry: Union[Geometry, Mapping[str, Any]],
        budget_tokens: int = 0,
        mode: str = "speculative",
        transport: str = "grpc",
        max_tokens: int = 0,
        label: str = "",
        correction_threshold: Optional[float] = None,
        correction_trigger: Optional[str] = None,
        correction_max_loss: Optional[float] = None,
        budget_policy: str = "",
        policy_params: Optional[Mapping[str, str]] = None,
        request_id: Optional[str] = None,
        residency_policy: str = "",
        host_drop: str = "",
        host_tokens: int = 0,
        summary: Optional[str] = None,
        sink_pages: Optional[int] = None,
        recent_pages: Optional[int] = None,
    ) -> "Session":
        """Opens a session. `geometry`: a Geometry or a dict of its fields. Zero
        budget_tokens / max_tokens take the daemon's defaults; `mode` is one of
        speculative, sync, full, drop; `transport` grpc or shm (shm sessions need
        libkvtier's in-process Retriever: this client only drives grpc ones).
        `correction_threshold` (τ) is any finite number (None: 0.7; > 1 always corrects,
        <= -1 never); `correction_trigger` is cosine or mass (None: the daemon's default,
        cosine); `correction_max_loss` in [0, 1] is the mass trigger's threshold (None: 0.1).
        The options are checked by the daemon (the library's ResolveSequenceOptions): a
        refusal is a KvtierError INVALID_ARGUMENT with its message.
        `request_id` makes a retry safe: while the session it opened is open, opening with
        the same id returns that session (default: a fresh random id per call).
        `host_drop` "demote" with `host_tokens` below max_tokens keeps only that many tokens
        per layer in the host tier and moves the lowest-scoring pages to the daemon's cold
        tier (they come back when a step selects them; needs a cold tier).
        `summary` is what a page is scored by: key-codes, center-mad or minmax (None: the
        daemon's default, key-codes). `sink_pages` and `recent_pages` split the budget (the
        rest is selected); each None takes the library's split of the budget (an eighth sink,
        at least 1 page; an eighth recent, 2 pages to a quarter)."""
        if not isinstance(geometry, Geometry):
            geometry = Geometry(**geometry)
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r}; expected one of {sorted(_MODES)}")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport {transport!r}; expected one of {sorted(_TRANSPORTS)}")
        retrieval = pb.RetrievalOptions(
            mode=_MODES[mode],
            budget_tokens=budget_tokens,
            max_tokens=max_tokens,
            host_tokens=host_tokens,
        )
        if correction_threshold is not None:
            retrieval.correction_threshold = correction_threshold
        if correction_trigger is not None:
            if correction_trigger not in _CORRECTION_TRIGGERS:
                raise ValueError(
                    f"correction_trigger {correction_trigger!r}; expected one of "
                    f"{list(_CORRECTION_TRIGGERS)}"
                )
            retrieval.correction_trigger = correction_trigger
        if correction_max_loss is not None:
            retrieval.correction_max_loss = correction_max_loss
        if summary is not None:
            if summary not in _SUMMARIES:
                raise ValueError(f"summary {summary!r}; expected one of {list(_SUMMARIES)}")
            retrieval.summary = summary
        if sink_pages is not None:
            retrieval.sink_pages = sink_pages
        if recent_pages is not None:
            retrieval.recent_pages = recent_pages
        request = pb.OpenSessionRequest(
            tenant=self.tenant,
            geometry=geometry.to_proto(),
            retrieval=retrieval,
            policy=pb.PolicyOptions(
                budget_policy=budget_policy,
                residency_policy=residency_policy,
                host_drop=host_drop,
                params=dict(policy_params or {}),
            ),
            transport=_TRANSPORTS[transport],
            label=label,
            request_id=request_id or uuid.uuid4().hex,
        )
        reply = self._call(self._stub.OpenSession, request)
        return Session(self, reply.session)

    def reattach(self, session_id: str) -> "Session":
        """Takes over a session (after a restart of this process): bumps its epoch."""
        reply = self._call(self._stub.Reattach, pb.ReattachRequest(session_id=session_id))
        return Session(self, reply.session)

    def suspend_session(self, session_id: str) -> pb.SessionInfo:
        """Suspends a session for a later reattach (SuspendSession): bumps its epoch; the
        daemon may move its pages to its cold tier until `reattach` resumes it."""
        reply = self._call(
            self._stub.SuspendSession, pb.SuspendSessionRequest(session_id=session_id)
        )
        return reply.session

    def list_sessions(self) -> List[pb.SessionInfo]:
        """The tenant's sessions."""
        return list(self._call(self._stub.ListSessions, pb.ListSessionsRequest()).sessions)

    def stats(self, session_id: str = "") -> pb.GetStatsReply:
        """The tenant's statistics, and one session's when `session_id` is given."""
        return self._call(self._stub.GetStats, pb.GetStatsRequest(session_id=session_id))


class Session:
    """One open session of a Client (GRPC transport). Use from one thread at a time."""

    def __init__(self, client: Client, info: pb.SessionInfo) -> None:
        self._client = client
        self.info = info
        self.id: str = info.session_id
        self.geometry = Geometry.from_proto(info.geometry)
        layers = self.geometry.num_layers
        # Per layer: the tokens the daemon holds (where the next offload starts) and the
        # steps it ran (the next step's number), as the daemon last said.
        self._tokens = (list(info.committed_tokens) + [0] * layers)[:layers]
        self._steps = (list(info.steps_run) + [0] * layers)[:layers]
        self._suspended = False

    def num_tokens(self, layer: int) -> int:
        """The tokens of `layer` the daemon holds, as it last said."""
        return self._tokens[layer]

    def _refresh_tokens(self) -> None:
        for s in self._client.list_sessions():
            if s.session_id == self.id:
                self._tokens = list(s.committed_tokens)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _tokens_per_chunk(self) -> int:
        """The most tokens one OffloadRequest may carry under the daemon's limits."""
        limits = self._client.limits()
        by_bytes = max(
            1,
            (limits.max_message_bytes - _MESSAGE_OVERHEAD_BYTES) // (2 * self.geometry.token_bytes),
        )
        return min(by_bytes, limits.max_tokens_per_offload or by_bytes)

    def _split(
        self, k: bytes, v: bytes, num_tokens: Optional[int], commit: bool
    ) -> Iterator[Chunk]:
        """Cuts one offload into chunks within the daemon's limits; only the last commits."""
        row = self.geometry.token_bytes
        if num_tokens is None:
            num_tokens = len(k) // row
        if len(k) != num_tokens * row or len(v) != num_tokens * row:
            # Let the daemon say what is wrong, in one message.
            yield Chunk(k=k, v=v, num_tokens=num_tokens, commit=commit)
            return
        step = self._tokens_per_chunk()
        for start in range(0, max(num_tokens, 1), step):
            end = min(start + step, num_tokens)
            yield Chunk(
                k=k[start * row : end * row],
                v=v[start * row : end * row],
                num_tokens=end - start,
                commit=commit and end == num_tokens,
            )

    def offload(
        self,
        layer: int,
        k: Union[bytes, Iterable[Chunk]],
        v: Optional[bytes] = None,
        num_tokens: Optional[int] = None,
        commit: bool = True,
    ) -> OffloadResult:
        """Appends tokens to `layer` in one Offload stream.

        Either `k` and `v` bytes, NHD [num_tokens][Hkv][d] in the session dtype (num_tokens
        defaults to what the bytes hold; the tokens are split into messages within the
        daemon's limits, and the last one commits when `commit`), or `k` an iterable of
        Chunk, sent as given. Chunks become visible at a committing message or the stream's
        clean end; a broken stream leaves nothing uncommitted behind.
        """
        numbered = isinstance(k, (bytes, bytearray, memoryview))
        if numbered:
            if v is None:
                raise ValueError("offload: v is required with k bytes")
            chunks: Iterable[Chunk] = self._split(bytes(k), bytes(v), num_tokens, commit)
        else:
            chunks = k

        def requests() -> Iterator[pb.OffloadRequest]:
            start = self._tokens[layer] if 0 <= layer < len(self._tokens) else 0
            for c in chunks:
                request = pb.OffloadRequest(
                    session_id=self.id,
                    layer=layer,
                    num_tokens=c.num_tokens,
                    k=c.k,
                    v=c.v,
                    commit=c.commit,
                )
                # The daemon refuses a chunk that does not continue the layer: a retried
                # offload can never append a token twice.
                if numbered:
                    request.start_token = start
                start += c.num_tokens
                yield request

        try:
            reply = self._client._call(self._client._stub.Offload, requests())
        except KvtierError:
            # The commits made before the stream broke stand: learn where the layer ends.
            self._refresh_tokens()
            raise
        if len(reply.layer_tokens) == len(self._tokens):
            self._tokens = list(reply.layer_tokens)
        return OffloadResult(
            committed_tokens=reply.committed_tokens, layer_tokens=list(reply.layer_tokens)
        )

    def step(
        self, layer: int, q: bytes, want_output: bool = True, step: Optional[int] = None
    ) -> StepResult:
        """One decode step of `layer` on the daemon's Retriever with q [Hq][d].

        Steps are numbered per layer (`step`, default: the next). Calling again with the
        number of a step whose reply was lost (a deadline, a broken connection) and the same
        q returns that step's reply (`replayed`) without running it twice; when the step the
        session thought lost did run and a new q comes, the next number is used."""
        number = step if step is not None else self._steps[layer] + 1
        request = pb.StepRequest(
            session_id=self.id, layer=layer, q=bytes(q), want_output=want_output, step=number
        )
        try:
            r = self._client._call(self._client._stub.Step, request)
        except KvtierError as e:
            ran = e.trailers.get("x-kvtier-steps-run")
            if (
                step is not None
                or e.code != grpc.StatusCode.FAILED_PRECONDITION
                or ran != str(number)
            ):
                raise
            self._steps[layer] = number  # it ran with the q of the lost call
            request.step = number + 1
            r = self._client._call(self._client._stub.Step, request)
        self._steps[layer] = max(self._steps[layer], r.step)
        return StepResult(
            layer=r.layer,
            num_tokens=r.num_tokens,
            num_slots=r.num_slots,
            slot_table=list(r.slot_table),
            output=r.output,
            lse=list(r.lse),
            corrected_heads=r.corrected_heads,
            step=r.step,
            replayed=r.replayed,
        )

    def report_signals(
        self,
        first_position: int,
        num_tokens: int = 1,
        logits: Optional[Sequence[float]] = None,
        hidden_delta: Optional[Sequence[float]] = None,
        num_layers: int = 0,
    ) -> bool:
        """What the engine observed after a forward pass over the tokens at first_position ..
        + num_tokens - 1, for the session's policies in the daemon (applied from the next
        step): the next-token logits after the last token (Conf-KV), and the hidden-state
        changes [num_tokens][num_layers] flattened (EpiKV). Reporting tokens already reported
        is a retry: nothing is applied again and True (replayed) comes back."""
        r = self._client._call(
            self._client._stub.ReportSignals,
            pb.ReportSignalsRequest(
                session_id=self.id,
                first_position=first_position,
                num_tokens=num_tokens,
                logits=list(logits or []),
                hidden_delta=list(hidden_delta or []),
                num_layers=num_layers,
            ),
        )
        return r.replayed

    def observe_queries(self, layer: int, q: bytes, first_position: int) -> bool:
        """The prompt's last n queries of `layer`, q [n][Hq][d] in the session dtype, at
        positions first_position .. + n - 1, after the prompt was appended (XKV, KV-Compress,
        the attention rankers). True (replayed) when that window was applied already."""
        r = self._client._call(
            self._client._stub.ReportSignals,
            pb.ReportSignalsRequest(
                session_id=self.id,
                observe_layer=layer,
                observe_q=bytes(q),
                observe_first_position=first_position,
            ),
        )
        return r.replayed

    def fetch(self, layer: int, pages: Optional[Sequence[int]] = None) -> List[FetchedPage]:
        """Committed pages of `layer`, HND; None or empty: all of them."""
        request = pb.FetchRequest(session_id=self.id, layer=layer, pages=list(pages or []))
        out: List[FetchedPage] = []
        try:
            for reply in self._client._call(self._client._stub.Fetch, request):
                out.extend(
                    FetchedPage(layer=p.layer, page=p.page, generation=p.generation, data=p.data)
                    for p in reply.pages
                )
        except grpc.RpcError as e:  # raised while iterating the stream
            raise _error(e) from None
        return out

    def stats(self) -> pb.SessionStats:
        """The session's counters (steps, tokens, pages, recall, correction)."""
        return self._client.stats(self.id).session

    def suspend(self) -> pb.SessionInfo:
        """Suspends the session (Client.suspend_session); Client.reattach resumes it. This
        object's close() then leaves the daemon's session alone."""
        info = self._client.suspend_session(self.id)
        self._suspended = True
        return info

    def close(self) -> pb.CloseSessionReply:
        """Closes the session and frees its host memory (a suspended one is left alone)."""
        if self._suspended:
            return pb.CloseSessionReply()
        return self._client._call(
            self._client._stub.CloseSession, pb.CloseSessionRequest(session_id=self.id)
        )

