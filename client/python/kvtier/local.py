"""kvtier's data path in the Python process: devices, sequences and batches over libkvtier's C
API (kvtier._native), tensors in and views out by DLPack (kvtier._dlpack).

    import numpy as np, kvtier
    dev = kvtier.Device("cpu")                       # or "cuda" (adopting torch's stream)
    geo = kvtier.LocalGeometry(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64,
                               dtype="float16")
    seq = kvtier.Sequence(dev, geo, kvtier.SequenceOptions(budget_tokens=512, max_tokens=8192))
    seq.append(0, k, v)                              # [n][Hkv][d], the geometry's dtype
    seq.decode(0, q, out)                            # q, out [Hq][d]: kvtier's attention
    view = seq.batch.begin_step(0, [seq], q1)[0]     # or the engine's own kernel:
    k_cache = torch.from_dlpack(view.k_cache)        # [S][p][Hkv][d], slot_table [Hkv][S] (-1)
    ...
    seq.batch.end_step(0, [seq], q1)

Every sequence is a member of a batch: one made alone (Sequence) is the member of its own
batch of one (seq.batch), and a Batch makes several that step together. Inputs are anything
with ``__dlpack__`` (torch, numpy, CuPy) or a writable buffer, in the geometry's dtype and the
documented shape, contiguous, in memory of the device: anything else raises kvtier.Error
naming the argument and what was expected — nothing is converted or copied. On the CPU device
every call returns once its work has run (the caller may reuse or read its buffers); on CUDA
the work is enqueued on the batch's compute stream (the engine's, when `stream` adopts it) and
the caller orders its own work after it on that stream, keeping its tensors alive until then.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Dict, List, Optional, Sequence as Seq, Tuple

from kvtier import _dlpack
from kvtier import _native

_MODES = {"speculative": 0, "sync": 1, "full": 2, "drop": 3}
_TRIGGERS = {"cosine": 0, "mass": 1}
_SUMMARIES = {"minmax": 0, "center-mad": 1, "key-codes": 2}
_RECALLS = {"auto": 0, "batched_dma": 2, "zero_copy": 3}
_DEVICES = {"auto": 0, "cpu": 1, "cuda": 2}
_DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2}
_CODES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class Error(Exception):
    """A call kvtier refused or that failed: `code` is the canonical status name
    (INVALID_ARGUMENT, OUT_OF_RANGE, ...), the message says what and which limit."""

    def __init__(self, code: str, message: str):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message


def _check(rc: int) -> None:
    if rc != 0:
        message = _native.lib().kvtier_last_error().decode("utf-8", "replace")
        raise Error(_CODES.get(rc, str(rc)), message)


def _invalid(message: str) -> Error:
    return Error("INVALID_ARGUMENT", message)


def _choice(name: str, value: str, table: Dict[str, int]) -> int:
    if value not in table:
        raise _invalid("%s = %r: must be one of %s" % (name, value, ", ".join(sorted(table))))
    return table[value]


@dataclasses.dataclass(frozen=True)
class LocalGeometry:
    """The model shape (kvtier/geometry.h); dtype: float16, bfloat16 or float32."""
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 32
    dtype: str = "float16"

    def _c(self) -> _native.Geometry:
        return _native.Geometry(self.num_layers, self.num_q_heads, self.num_kv_heads,
                                self.head_dim, self.page_size,
                                _choice("geometry.dtype", self.dtype, _DTYPES))


# cudaStream_t values that name a default stream: 0 (the legacy one, torch's default stream's
# cuda_stream), cudaStreamLegacy and cudaStreamPerThread.
_DEFAULT_STREAMS = (0, 1, 2)


@dataclasses.dataclass
class SequenceOptions:
    """kvtier/options.h's SequenceOptions as the C API takes them; the defaults are the
    library's (kvtier_sequence_options_init). `stream`: on CUDA, the engine's stream to adopt
    (a torch.cuda.Stream, or its integer cudaStream_t; not a default stream, which is refused),
    so kvtier's work is ordered with the engine's; None: kvtier makes its own
    (Batch.native_stream hands it out). The drop-style policies (docs/policies.md):
    `budget_policy` (fixed, confidence, xkv, kv_compress), `residency_policy` (none,
    attention, h2o, epiphany, kv_compress), `host_drop` (refuse, evict, demote) and
    `policy_params` {"<policy>.<name>": value}; the policies that read the engine's signals
    get them through Sequence.report_signals and Sequence.observe_queries. `summary`: what a
    page is scored by, key-codes (the default), center-mad or minmax (no codes on the device:
    a quarter of the keys less; docs/eval.md, "Page summaries"). `sink_pages` and
    `recent_pages`, both or neither: the budget's split (the rest selected); None keeps the
    library's (an eighth sink, at least 1 page; an eighth recent, 2 pages to a quarter)."""
    mode: str = "speculative"
    budget_tokens: int = 2048
    max_tokens: int = 131072
    tau: float = 0.7
    trigger: str = "cosine"
    max_loss: float = 0.1
    summary: str = "key-codes"
    sink_pages: Optional[int] = None
    recent_pages: Optional[int] = None
    recall: str = "auto"
    capture_graphs: bool = False
    stream: Any = None
    budget_policy: str = "fixed"
    residency_policy: str = "none"
    host_drop: str = "refuse"
    policy_params: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def _c(self) -> _native.SequenceOptions:
        o = _native.SequenceOptions()
        _native.lib().kvtier_sequence_options_init(ctypes.byref(o))
        o.mode = _choice("mode", self.mode, _MODES)
        o.budget_tokens = int(self.budget_tokens)
        o.max_tokens = int(self.max_tokens)
        o.correction_threshold = float(self.tau)
        o.correction_trigger = _choice("trigger", self.trigger, _TRIGGERS)
        o.correction_max_loss = float(self.max_loss)
        o.summary = _choice("summary", self.summary, _SUMMARIES)
        _native.set_split(o, self.sink_pages, self.recent_pages)
        o.recall = _choice("recall", self.recall, _RECALLS)
        o.capture_graphs = 1 if self.capture_graphs else 0
        policy = _native.policy_options(self.budget_policy, self.residency_policy,
                                        self.host_drop, self.policy_params)
        o.policy = policy
        o._keep = policy  # its strings, for as long as the options live
        if self.stream is not None:
            handle = int(getattr(self.stream, "cuda_stream", self.stream))
            if handle in _DEFAULT_STREAMS:
                # Silently making kvtier's own stream instead would leave its work unordered
                # with the caller's (kvtier's streams do not synchronise with the default one).
                raise _invalid(
                    "stream: a default CUDA stream (handle %d%s) cannot be adopted: it "
                    "synchronises implicitly and cannot be captured; run under "
                    "torch.cuda.stream(torch.cuda.Stream()), or pass stream=None and order "
                    "your work with Batch.native_stream"
                    % (handle, ", torch's default stream" if handle == 0 else ""))
            o.compute_stream = handle
        return o


class Device:
    """A kvtier device: "cpu", "cuda" or "auto" (CUDA when a GPU is usable). The sequences and
    batches made on it keep it (the library's handles share it), so objects may be collected
    in any order."""

    def __init__(self, kind: str = "cpu"):
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_device_create(_choice("kind", kind, _DEVICES),
                                                  ctypes.byref(handle)))
        self._h = handle
        self.kind = "cuda" if _native.lib().kvtier_device_kind(handle) == 2 else "cpu"

    def __del__(self):
        h = getattr(self, "_h", None)
        self._h = None
        if h and _native is not None:
            _native.lib().kvtier_device_free(h)

    def __repr__(self) -> str:
        return "kvtier.Device(%r)" % self.kind


class WorkingSetView:
    """One member's working set of one layer for this step (kvtier::WorkingSetView), in device
    memory, valid until the member's next step of the layer: ``k_cache`` and ``v_cache``
    [S][page_size][Hkv][d] in the geometry's dtype, ``slot_table`` [Hkv][S] int32 (the logical
    page each slot holds for each KV head; -1: empty, so a kernel can skip it), and
    ``partial_page`` / ``partial_len`` int32 [1] (the page being filled, -1 for none, and its
    tokens). Each is a DLPack producer: torch.from_dlpack(view.k_cache)."""

    def __init__(self, c: _native.WorkingSet, geometry: LocalGeometry, device_type: int,
                 owner: Any):
        g = geometry
        self.layer, self.num_slots, self.num_tokens = c.layer, c.num_slots, c.num_tokens
        cache = (c.num_slots, g.page_size, g.num_kv_heads, g.head_dim)
        self.k_cache = _dlpack.View(c.k_cache, cache, g.dtype, device_type, 0, owner)
        self.v_cache = _dlpack.View(c.v_cache, cache, g.dtype, device_type, 0, owner)
        self.slot_table = _dlpack.View(c.slot_table, (g.num_kv_heads, c.num_slots), "int32",
                                       device_type, 0, owner)
        self.partial_page = _dlpack.View(c.partial_page, (1,), "int32", device_type, 0, owner)
        self.partial_len = _dlpack.View(c.partial_len, (1,), "int32", device_type, 0, owner)


class Batch:
    """Sequences of one geometry and options whose layer steps run together
    (kvtier::SequenceBatch): ``add()`` makes a member; ``begin_step``, ``attend`` and
    ``end_step`` step the members given (each at most once), their queries q [n][Hq][d] in that
    order."""

    def __init__(self, device: Device, geometry: LocalGeometry,
                 options: Optional[SequenceOptions] = None, max_batch: int = 8, *,
                 _handle: Optional[ctypes.c_void_p] = None, _owned: bool = True):
        self.device, self.geometry = device, geometry
        self._owned = _owned
        if _handle is not None:
            self._h = _handle
            return
        self._options = options or SequenceOptions()
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_batch_create(device._h, ctypes.byref(geometry._c()),
                                                 ctypes.byref(self._options._c()),
                                                 int(max_batch), ctypes.byref(handle)))
        self._h = handle

    def __del__(self):
        h = getattr(self, "_h", None)
        self._h = None
        if h and getattr(self, "_owned", False) and _native is not None:
            _native.lib().kvtier_batch_free(h)

    @property
    def max_batch(self) -> int:
        return _native.lib().kvtier_batch_max_batch(self._h)

    def add(self) -> "Sequence":
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_batch_add(self._h, ctypes.byref(handle)))
        return Sequence._member(self, handle)

    # -- the step protocol --------------------------------------------------------------
    def _members(self, members: Seq["Sequence"], what: str):
        if len(members) < 1:
            raise _invalid("%s: members: at least one sequence" % what)
        arr = (ctypes.c_void_p * len(members))()
        for i, m in enumerate(members):
            if not isinstance(m, Sequence) or m._h is None:
                raise _invalid("%s: members[%d] is not an open kvtier.Sequence" % (what, i))
            arr[i] = m._h
        return arr

    def begin_step(self, layer: int, members: Seq["Sequence"], q: Any) -> List[WorkingSetView]:
        """Readies the members' working sets of `layer` for q [n][Hq][d] (or [Hq][d] for one);
        returns each member's view."""
        g = self.geometry
        arr = self._members(members, "begin_step")
        qt = _tensor("q", q, _qshape(g, len(members), q), g.dtype, self.device)
        views = (_native.WorkingSet * len(members))()
        _check(_native.lib().kvtier_batch_begin_step(self._h, int(layer), arr, len(members),
                                                     qt.ptr, views))
        self._settle()
        dt = _dlpack.CUDA if self.device.kind == "cuda" else _dlpack.CPU
        return [WorkingSetView(v, g, dt, members[i]) for i, v in enumerate(views)]

    def attend(self, layer: int, members: Seq["Sequence"], q: Any, out: Any,
               lse: Any = None) -> None:
        """kvtier's sparse attention of q over each member's working set into out (same shape
        as q); lse [n][Hq] float32, optional."""
        g = self.geometry
        arr = self._members(members, "attend")
        shape = _qshape(g, len(members), q)
        qt = _tensor("q", q, shape, g.dtype, self.device)
        ot = _tensor("out", out, shape, g.dtype, self.device, writable=True)
        lt = None if lse is None else _tensor("lse", lse, shape[:-1], "float32", self.device,
                                              writable=True)
        _check(_native.lib().kvtier_batch_attend(self._h, int(layer), arr, len(members), qt.ptr,
                                                 ot.ptr, None if lt is None else lt.ptr))
        self._settle()

    def end_step(self, layer: int, members: Seq["Sequence"], q: Any) -> None:
        """Ends the members' step of `layer`: launches the next step's selection and recall
        with the same q given to begin_step."""
        g = self.geometry
        arr = self._members(members, "end_step")
        qt = _tensor("q", q, _qshape(g, len(members), q), g.dtype, self.device)
        _check(_native.lib().kvtier_batch_end_step(self._h, int(layer), arr, len(members),
                                                   qt.ptr))
        self._settle()

    def synchronize(self) -> None:
        """Waits for the batch's compute stream."""
        _check(_native.lib().kvtier_batch_synchronize(self._h))

    @property
    def native_stream(self) -> int:
        """CUDA: the cudaStream_t (an int) kvtier enqueues on, e.g. for
        torch.cuda.ExternalStream; Error UNIMPLEMENTED on the CPU."""
        out = ctypes.c_void_p()
        _check(_native.lib().kvtier_batch_native_stream(self._h, ctypes.byref(out)))
        return int(out.value or 0)

    def _settle(self) -> None:
        # On the CPU the compute stream is a worker thread: the caller's buffers are read and
        # written there, so the call returns once it has run.
        if self.device.kind == "cpu":
            self.synchronize()


class Sequence:
    """The KV cache of one sequence, all layers, in kvtier's tiers (kvtier::LocalSequence).
    Made alone — ``Sequence(device, geometry, options)``, with a private host tier of
    max_tokens per layer in pinned host memory — it is the one member of its own batch of one
    (``seq.batch``); ``Batch.add()`` makes members of a shared batch."""

    def __init__(self, device: Device, geometry: LocalGeometry,
                 options: Optional[SequenceOptions] = None):
        self.device, self.geometry = device, geometry
        self._options = options or SequenceOptions()
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_sequence_create(device._h, ctypes.byref(geometry._c()),
                                                    ctypes.byref(self._options._c()),
                                                    ctypes.byref(handle)))
        self._h = handle
        self._parent = None
        # Its batch of one: valid while this sequence lives (the wrapper does not keep it).
        self.batch = Batch(device, geometry, _handle=ctypes.c_void_p(
            _native.lib().kvtier_sequence_batch(handle)), _owned=False)

    @classmethod
    def _member(cls, batch: Batch, handle: ctypes.c_void_p) -> "Sequence":
        s = cls.__new__(cls)
        s.device, s.geometry, s._h = batch.device, batch.geometry, handle
        s._options = batch._options
        s._parent = batch
        s.batch = batch
        return s

    @property
    def options(self) -> SequenceOptions:
        """The options the sequence was made with (its batch's, for a member)."""
        return self._options

    def __del__(self):
        h = getattr(self, "_h", None)
        self._h = None
        if h and _native is not None:
            _native.lib().kvtier_sequence_free(h)

    def _live(self, what: str):
        if self._h is None:
            raise Error("FAILED_PRECONDITION", "%s: the sequence was freed" % what)
        return self._h

    def append(self, layer: int, k: Any, v: Any) -> None:
        """Appends n tokens of K and V, [n][Hkv][d] each, to `layer`."""
        g = self.geometry
        kt = _tensor("k", k, None, g.dtype, self.device, tail=(g.num_kv_heads, g.head_dim))
        vt = _tensor("v", v, kt.shape, g.dtype, self.device)
        _check(_native.lib().kvtier_sequence_append(self._live("append"), int(layer), kt.ptr,
                                                    vt.ptr, int(kt.shape[0])))
        self.batch._settle()

    def decode(self, layer: int, q: Any, out: Any, lse: Any = None) -> None:
        """One decode step of `layer`: kvtier's attention of q [Hq][d] over the working set into
        out [Hq][d] (lse [Hq] float32, optional), and the next step's selection and recall."""
        g = self.geometry
        shape = (g.num_q_heads, g.head_dim)
        qt = _tensor("q", q, shape, g.dtype, self.device)
        ot = _tensor("out", out, shape, g.dtype, self.device, writable=True)
        lt = None if lse is None else _tensor("lse", lse, (g.num_q_heads,), "float32",
                                              self.device, writable=True)
        _check(_native.lib().kvtier_sequence_decode(self._live("decode"), int(layer), qt.ptr,
                                                    ot.ptr, None if lt is None else lt.ptr))
        self.batch._settle()

    def report_signals(self, first_position: int, num_tokens: int = 1, logits: Any = None,
                       hidden_delta: Any = None) -> None:
        """What the engine observed after a forward pass over the tokens at first_position ..
        + num_tokens - 1, for the policies that read it (applied from the next step): logits,
        the next-token logits after the last token ([vocab] float32, host memory; Conf-KV);
        hidden_delta, ||h_l(t) - h_l(t-1)|| per token and layer ([num_tokens][num_layers]
        float32, host memory; EpiKV). Ignored when no policy reads them."""
        s, keep = _step_signals(first_position, num_tokens, logits, hidden_delta)
        _check(_native.lib().kvtier_sequence_report_signals(self._live("report_signals"),
                                                            ctypes.byref(s)))
        del keep

    def observe_queries(self, layer: int, q: Any, first_position: int) -> None:
        """The prompt's last n queries q [n][Hq][d] of `layer` (the geometry's dtype, in the
        device's memory), at positions first_position .. + n - 1, after the prompt was
        appended: the observation window of XKV, KV-Compress and Conf-KV's ranker. Blocks until
        done; nothing happens when no policy reads attention."""
        g = self.geometry
        qt = _tensor("q", q, None, g.dtype, self.device, tail=(g.num_q_heads, g.head_dim))
        _check(_native.lib().kvtier_sequence_observe_queries(
            self._live("observe_queries"), int(layer), qt.ptr, int(qt.shape[0]),
            int(first_position)))
        self.batch._settle()

    def num_tokens(self, layer: int = 0) -> int:
        return _native.lib().kvtier_sequence_num_tokens(self._live("num_tokens"), int(layer))

    def wait(self) -> None:
        """Waits for all work enqueued so far, background recalls included."""
        _check(_native.lib().kvtier_sequence_wait(self._live("wait")))

    def stats(self) -> Dict[str, int]:
        """Every counter of include/kvtier/counters.h by name (steps, recalled_pages, ...) for
        the steps whose work is known to have run (after wait(): all)."""
        lib = _native.lib()
        out = {}
        value = ctypes.c_int64()
        for i in range(lib.kvtier_counter_count()):
            name = lib.kvtier_counter_name(i)
            _check(lib.kvtier_sequence_counter(self._live("stats"), name, ctypes.byref(value)))
            out[name.decode()] = value.value
        return out

    def correction_rate(self) -> float:
        s = self.stats()
        return s["corrected_heads"] / s["checked_heads"] if s["checked_heads"] else 0.0

    def last_step(self, layer: int) -> Tuple[int, List[List[int]]]:
        """(KV heads corrected, the slot table [Hkv][S] the attention read) of the layer's last
        step whose work has run (after wait(): the last)."""
        g = self.geometry
        corrected, slots = ctypes.c_int32(), ctypes.c_int32()
        _check(_native.lib().kvtier_sequence_last_step(self._live("last_step"), int(layer),
                                                       ctypes.byref(corrected),
                                                       ctypes.byref(slots), None, 0))
        table = (ctypes.c_int32 * max(1, g.num_kv_heads * slots.value))()
        _check(_native.lib().kvtier_sequence_last_step(self._h, int(layer), None, None, table,
                                                       len(table)))
        rows = [list(table[h * slots.value:(h + 1) * slots.value])
                for h in range(g.num_kv_heads)]
        return corrected.value, rows

    def close(self) -> None:
        """Stops the sequence (its work drained); later calls fail FAILED_PRECONDITION."""
        _check(_native.lib().kvtier_sequence_close(self._live("close")))


def _qshape(g: LocalGeometry, n: int, q: Any) -> Tuple[int, ...]:
    """[n][Hq][d], or [Hq][d] when one member's q is given without the batch dimension."""
    ndim = len(getattr(q, "shape", ()))
    if n == 1 and ndim == 2:
        return (g.num_q_heads, g.head_dim)
    return (n, g.num_q_heads, g.head_dim)


def _step_signals(first_position: int, num_tokens: int, logits: Any,
                  hidden_delta: Any) -> Tuple[_native.StepSignals, List[Any]]:
    """The C API's kvtier_step_signals over the caller's arrays, and what keeps them alive."""
    s = _native.StepSignals()
    s.first_position = int(first_position)
    s.num_tokens = int(num_tokens)
    keep = []
    if logits is not None:
        lt = _host_floats("logits", logits, "[vocab]", 1)
        keep.append(lt)
        s.vocab = int(lt.shape[0])
        s.logits = ctypes.cast(lt.ptr, ctypes.POINTER(ctypes.c_float))
    if hidden_delta is not None:
        ht = _host_floats("hidden_delta", hidden_delta, "[num_tokens, num_layers]", 2)
        keep.append(ht)
        if ht.shape[0] != int(num_tokens):
            raise _invalid("hidden_delta: %d rows, want num_tokens = %d"
                           % (ht.shape[0], int(num_tokens)))
        s.num_layers = int(ht.shape[1])
        s.hidden_delta = ctypes.cast(ht.ptr, ctypes.POINTER(ctypes.c_float))
    return s, keep


def _host_floats(name: str, obj: Any, shape: str, ndim: int) -> _dlpack.Borrowed:
    """Reads `obj` as a C-contiguous float32 tensor of `ndim` dimensions in host memory, or
    raises Error naming `name` and what was expected."""
    try:
        t = _dlpack.borrow(obj)
    except TypeError as e:
        raise _invalid("%s: %s" % (name, e)) from None
    if (t.dtype != "float32" or len(t.shape) != ndim or min(t.shape, default=0) < 1
            or not t.contiguous or t.device_type not in (_dlpack.CPU, _dlpack.CUDA_HOST)):
        raise _invalid("%s: expected a contiguous float32 tensor %s in host memory; got %s %s"
                       "%s%s" % (name, shape, t.dtype, list(t.shape),
                                 "" if t.contiguous else ", not contiguous",
                                 "" if t.device_type in (_dlpack.CPU, _dlpack.CUDA_HOST)
                                 else " on a device"))
    return t


def _tensor(name: str, obj: Any, shape: Optional[Tuple[int, ...]], dtype: str, device: Device,
            writable: bool = False, tail: Tuple[int, ...] = ()) -> _dlpack.Borrowed:
    """Reads `obj` as a C-contiguous `dtype` tensor of `shape` (or, with shape None, of
    [n] + tail) in `device`'s memory, or raises Error naming `name` and what was expected."""
    try:
        t = _dlpack.borrow(obj)
    except TypeError as e:
        raise _invalid("%s: %s" % (name, e)) from None
    want = ("[n, %s]" % ", ".join(map(str, tail))) if shape is None else list(shape)
    where = "cuda" if device.kind == "cuda" else "cpu"
    expected = "a contiguous %s tensor %s on %s" % (dtype, want, where)
    got_dev = {_dlpack.CPU: "cpu", _dlpack.CUDA: "cuda", _dlpack.CUDA_HOST: "cuda_host"}.get(
        t.device_type, "device type %d" % t.device_type)
    got = "%s %s on %s%s" % (t.dtype, list(t.shape), got_dev,
                             "" if t.contiguous else ", not contiguous")
    ok_shape = (t.shape == tuple(shape)) if shape is not None else (
        len(t.shape) == len(tail) + 1 and t.shape[1:] == tuple(tail) and t.shape[0] >= 1)
    readable = {"cpu": (_dlpack.CPU, _dlpack.CUDA_HOST),
                "cuda": (_dlpack.CUDA, _dlpack.CUDA_HOST)}[where]
    if t.dtype != dtype or not ok_shape or not t.contiguous or t.device_type not in readable:
        raise _invalid("%s: expected %s; got %s" % (name, expected, got))
    if writable and t.ptr == 0:
        raise _invalid("%s: a null buffer" % name)
    return t
