"""kvtierd's shared-memory sessions from Python, over libkvtier's C API (kvtier/c_api.h).

An SHM session's KV cache lives in the tenant's arena that kvtierd owns, so it outlives the
Python process: a process that died (or suspended its session) leaves the committed pages
behind, and another one reattaches by the session id and re-appends from num_tokens().
The session's Retriever runs in this process on a CPU backend (the C API's sessions), so the
tensors are host memory:

    import kvtier.daemon as kd
    client = kd.connect("unix:///run/kvtier/kvtierd.sock", tenant="a", token="...")
    s = client.open_session(kvtier.LocalGeometry(...), mode="speculative", budget_tokens=512)
    s.append(layer, k, v)                  # [n][Hkv][d], the geometry's dtype, on the CPU
    s.decode(layer, q, out)                # [Hq][d]
    s.flush(); sid = s.id                  # committed: survives this process
    ...
    s = client.reattach(sid, geometry)     # in a new process; s.num_tokens(layer)
    s.suspend() / s.close()

gRPC sessions (retrieval in the daemon) are kvtier.client's. Tensors follow kvtier.local's
rules (DLPack or typed buffers, exact dtype and shape, contiguous; kvtier.Error otherwise).
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Tuple

from kvtier import _native
from kvtier.local import (Device, LocalGeometry, _MODES, _SUMMARIES, _TRIGGERS, _check,
                          _choice, _step_signals, _tensor)

_CPU = None  # tensors of an SHM session are host memory


def _cpu() -> Device:
    global _CPU
    if _CPU is None:
        _CPU = Device("cpu")
    return _CPU


class Client:
    """A connection to kvtierd (kvtier_connect): thread-safe."""

    def __init__(self, target: str, tenant: Optional[str] = None, token: Optional[str] = None,
                 timeout_ms: int = 30000, attach_socket: Optional[str] = None):
        o = _native.ClientOptions()
        _native.lib().kvtier_client_options_init(ctypes.byref(o))
        self._strings = [x.encode() if x is not None else None
                         for x in (tenant, token, "kvtier-python", attach_socket)]
        o.tenant, o.token, o.client_name, o.attach_socket = self._strings
        o.rpc_timeout_ms = int(timeout_ms)
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_connect(target.encode(), ctypes.byref(o),
                                            ctypes.byref(handle)))
        self._h = handle

    def __del__(self):
        h = getattr(self, "_h", None)
        self._h = None
        if h and _native is not None:
            _native.lib().kvtier_client_free(h)

    def _options(self, g: LocalGeometry, mode: str, budget_tokens: int, max_tokens: int,
                 tau: Optional[float], trigger: str, max_loss: Optional[float],
                 label: Optional[str], policy: Dict[str, Any], summary: str,
                 sink_pages: Optional[int] = None,
                 recent_pages: Optional[int] = None) -> Tuple[_native.SessionOptions, Any]:
        o = _native.SessionOptions()
        _native.lib().kvtier_session_options_init(ctypes.byref(o))
        o.geometry = g._c()
        o.mode = _choice("mode", mode, _MODES)
        o.budget_tokens = int(budget_tokens)
        o.max_tokens = int(max_tokens)
        if tau is not None:
            o.correction_threshold = float(tau)
        o.correction_trigger = _choice("trigger", trigger, _TRIGGERS)
        if max_loss is not None:
            o.correction_max_loss = float(max_loss)
        o.summary = _choice("summary", summary, _SUMMARIES)
        _native.set_split(o, sink_pages, recent_pages)
        o.transport = 0  # SHM
        p = _native.policy_options(policy.get("budget_policy"), policy.get("residency_policy"),
                                   policy.get("host_drop"), policy.get("policy_params"))
        o.policy = p
        keep = (label.encode() if label is not None else None, p)
        o.label = keep[0]
        return o, keep

    def open_session(self, geometry: LocalGeometry, mode: str = "speculative",
                     budget_tokens: int = 2048, max_tokens: int = 0, tau: Optional[float] = None,
                     trigger: str = "cosine", max_loss: Optional[float] = None,
                     label: Optional[str] = None, summary: str = "key-codes",
                     sink_pages: Optional[int] = None, recent_pages: Optional[int] = None,
                     **policy: Any) -> "Session":
        """A new SHM session (max_tokens 0: the daemon's default capacity per layer).
        `summary`: what a page is scored by (key-codes, center-mad, minmax).
        `sink_pages`, `recent_pages`: both or neither, the budget's split (the rest selected;
        neither: the library's).
        `policy`: budget_policy, residency_policy, host_drop and policy_params, as
        kvtier.SequenceOptions takes them (they run in this process's sequence)."""
        o, keep = self._options(geometry, mode, budget_tokens, max_tokens, tau, trigger,
                                max_loss, label, _policy_kwargs(policy), summary, sink_pages,
                                recent_pages)
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_open_session(self._h, ctypes.byref(o), ctypes.byref(handle)))
        del keep
        return Session(self, handle, geometry)

    def reattach(self, session_id: str, geometry: LocalGeometry, mode: str = "speculative",
                 budget_tokens: int = 2048, max_tokens: int = 0, tau: Optional[float] = None,
                 trigger: str = "cosine", max_loss: Optional[float] = None,
                 **policy: Any) -> "Session":
        """Takes over session `session_id` (suspended, or left by a process that died): it
        comes back with its committed pages, and scores pages as it was opened to;
        num_tokens(layer) says where to re-append from."""
        o, keep = self._options(geometry, mode, budget_tokens, max_tokens, tau, trigger,
                                max_loss, None, _policy_kwargs(policy), "key-codes")
        handle = ctypes.c_void_p()
        _check(_native.lib().kvtier_reattach(self._h, session_id.encode(), ctypes.byref(o),
                                             ctypes.byref(handle)))
        del keep
        return Session(self, handle, geometry)


def _policy_kwargs(policy: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(policy) - {"budget_policy", "residency_policy", "host_drop",
                                    "policy_params"})
    if unknown:
        raise TypeError("unexpected keyword argument(s): %s" % ", ".join(unknown))
    return policy


def connect(target: str, **kwargs: Any) -> Client:
    return Client(target, **kwargs)


class Session:
    """An SHM session of kvtierd. Every call returns once the work that reads or writes the
    caller's buffers has run. One thread at a time."""

    def __init__(self, client: Client, handle: ctypes.c_void_p, geometry: LocalGeometry):
        self._client, self._h, self.geometry = client, handle, geometry

    def __del__(self):
        h = getattr(self, "_h", None)
        self._h = None
        if h and _native is not None:
            _native.lib().kvtier_session_free(h)  # not closed: detached, reattachable

    @property
    def id(self) -> str:
        return _native.lib().kvtier_session_id(self._h).decode()

    def num_tokens(self, layer: int = 0) -> int:
        return _native.lib().kvtier_num_tokens(self._h, int(layer))

    def append(self, layer: int, k: Any, v: Any) -> None:
        g = self.geometry
        kt = _tensor("k", k, None, g.dtype, _cpu(), tail=(g.num_kv_heads, g.head_dim))
        vt = _tensor("v", v, kt.shape, g.dtype, _cpu())
        _check(_native.lib().kvtier_append(self._h, int(layer), kt.ptr, vt.ptr, kt.shape[0]))

    def decode(self, layer: int, q: Any, out: Any, lse: Any = None,
               slot_table: bool = False) -> Optional[List[List[int]]]:
        """One step of `layer`; with slot_table, also the per-KV-head slot table the attention
        read ([Hkv][S], -1 empty), after the step's background work."""
        g = self.geometry
        shape = (g.num_q_heads, g.head_dim)
        qt = _tensor("q", q, shape, g.dtype, _cpu())
        ot = _tensor("out", out, shape, g.dtype, _cpu(), writable=True)
        lt = None if lse is None else _tensor("lse", lse, (g.num_q_heads,), "float32", _cpu(),
                                              writable=True)
        if not slot_table:
            _check(_native.lib().kvtier_decode(self._h, int(layer), qt.ptr, ot.ptr,
                                               None if lt is None else lt.ptr, None, None, 0))
            return None
        capacity = g.num_kv_heads * 4096
        table = (ctypes.c_int32 * capacity)()
        slots = ctypes.c_int32()
        _check(_native.lib().kvtier_decode(self._h, int(layer), qt.ptr, ot.ptr,
                                           None if lt is None else lt.ptr, ctypes.byref(slots),
                                           table, capacity))
        n = slots.value
        return [list(table[h * n:(h + 1) * n]) for h in range(g.num_kv_heads)]

    def report_signals(self, first_position: int, num_tokens: int = 1, logits: Any = None,
                       hidden_delta: Any = None) -> None:
        """The engine's signals for the session's policies, as kvtier.Sequence.report_signals
        takes them (they run in this process's sequence)."""
        s, keep = _step_signals(first_position, num_tokens, logits, hidden_delta)
        _check(_native.lib().kvtier_report_signals(self._h, ctypes.byref(s)))
        del keep

    def observe_queries(self, layer: int, q: Any, first_position: int) -> None:
        """The prompt's last queries q [n][Hq][d] of `layer`, as
        kvtier.Sequence.observe_queries takes them."""
        g = self.geometry
        qt = _tensor("q", q, None, g.dtype, _cpu(), tail=(g.num_q_heads, g.head_dim))
        _check(_native.lib().kvtier_observe_queries(self._h, int(layer), qt.ptr,
                                                    int(qt.shape[0]), int(first_position)))

    def flush(self) -> None:
        """Waits for every offload so far and commits it: it survives this process."""
        _check(_native.lib().kvtier_flush(self._h))

    def suspend(self) -> None:
        """Flushes, and asks the daemon to keep the session for a later reattach."""
        _check(_native.lib().kvtier_session_suspend(self._h))

    def close(self) -> None:
        """Closes the session in the daemon (its pages go back to the tenant)."""
        _check(_native.lib().kvtier_close_session(self._h))

    def detach(self) -> None:
        """Frees this handle without closing: the session stays for kvtier_reattach."""
        self.__del__()
