"""libkvtier's C API (include/kvtier/c_api.h) through ctypes.

Why ctypes over the C API and not a compiled extension: the C API is plain C99 with POD
structs, so one build of libkvtier.so serves every Python >= 3.9 and every torch (the
package links against neither; tensors cross as DLPack, kvtier._dlpack) — the way
llama-cpp-python binds llama.cpp, and unlike extensions pinned to one torch ABI, which is the
most common complaint of LMCache's users. ctypes releases the GIL around every foreign call,
so kvtier's long calls (a prefill's append, a step that waits) never stall other threads.

The library is found at $KVTIER_LIBRARY, else next to the package in a build tree
(<build>/libkvtier.so), else in the package directory, else by the system's search
(ctypes.util.find_library("kvtier"), e.g. after `cmake --install`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Optional

c_int32_p = ctypes.POINTER(ctypes.c_int32)

# The C ABI these structs mirror (KVTIER_ABI_VERSION of include/kvtier/c_api.h): a library
# of another version is not loaded (its structs may be laid out otherwise).
ABI_VERSION = 1


class Geometry(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("num_q_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("page_size", ctypes.c_int32), ("dtype", ctypes.c_int32)]


class PolicyOptions(ctypes.Structure):
    _fields_ = [("budget", ctypes.c_char_p), ("residency", ctypes.c_char_p),
                ("host_drop", ctypes.c_char_p), ("params", ctypes.POINTER(ctypes.c_char_p)),
                ("num_params", ctypes.c_int32)]


def policy_options(budget: Optional[str], residency: Optional[str], host_drop: Optional[str],
                   params) -> PolicyOptions:
    """A PolicyOptions that keeps its strings alive as long as it lives (None: the default);
    params: a mapping of "<policy>.<name>" to values."""
    p = PolicyOptions()
    if budget is not None:
        p.budget = str(budget).encode()
    if residency is not None:
        p.residency = str(residency).encode()
    if host_drop is not None:
        p.host_drop = str(host_drop).encode()
    items = ["%s=%s" % (k, v) for k, v in dict(params or {}).items()]
    if items:
        array = (ctypes.c_char_p * len(items))(*[i.encode() for i in items])
        p.params = ctypes.cast(array, ctypes.POINTER(ctypes.c_char_p))
        p._array = array  # the strings live as long as the struct
        p.num_params = len(items)
    return p


class SequenceOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("mode", ctypes.c_int32),
                ("budget_tokens", ctypes.c_int32), ("max_tokens", ctypes.c_int32),
                ("correction_threshold", ctypes.c_float), ("correction_trigger", ctypes.c_int32),
                ("correction_max_loss", ctypes.c_float), ("recall", ctypes.c_int32),
                ("capture_graphs", ctypes.c_int32), ("compute_stream", ctypes.c_void_p),
                ("policy", PolicyOptions), ("summary", ctypes.c_int32),
                ("split", ctypes.c_int32), ("sink_pages", ctypes.c_int32),
                ("recent_pages", ctypes.c_int32)]


class StepSignals(ctypes.Structure):
    _fields_ = [("first_position", ctypes.c_int64), ("num_tokens", ctypes.c_int32),
                ("vocab", ctypes.c_int32), ("logits", ctypes.POINTER(ctypes.c_float)),
                ("hidden_delta", ctypes.POINTER(ctypes.c_float)), ("num_layers", ctypes.c_int32)]


class WorkingSet(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_int32), ("num_slots", ctypes.c_int32),
                ("num_tokens", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("slot_table", ctypes.c_void_p), ("partial_page", ctypes.c_void_p),
                ("partial_len", ctypes.c_void_p)]


class ClientOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("tenant", ctypes.c_char_p),
                ("token", ctypes.c_char_p), ("client_name", ctypes.c_char_p),
                ("rpc_timeout_ms", ctypes.c_int64), ("attach_socket", ctypes.c_char_p),
                ("max_message_bytes", ctypes.c_uint64)]


class SessionOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("geometry", Geometry),
                ("mode", ctypes.c_int32), ("budget_tokens", ctypes.c_int32),
                ("max_tokens", ctypes.c_int32), ("correction_threshold", ctypes.c_float),
                ("transport", ctypes.c_int32), ("label", ctypes.c_char_p),
                ("correction_trigger", ctypes.c_int32), ("correction_max_loss", ctypes.c_float),
                ("host_tokens", ctypes.c_int32), ("host_drop_demote", ctypes.c_int32),
                ("policy", PolicyOptions), ("summary", ctypes.c_int32),
                ("split", ctypes.c_int32), ("sink_pages", ctypes.c_int32),
                ("recent_pages", ctypes.c_int32)]


def set_split(o, sink_pages, recent_pages):
    """The C options' split: both None keeps the library's split of the budget; both given,
    those sink and recent pages with the rest of the budget selected."""
    if (sink_pages is None) != (recent_pages is None):
        raise ValueError(f"sink_pages = {sink_pages}, recent_pages = {recent_pages}: give both "
                         "(the rest of the budget is selected) or neither (the library's split)")
    if sink_pages is not None:
        o.split, o.sink_pages, o.recent_pages = 1, int(sink_pages), int(recent_pages)


_PROTOTYPES = {
    # kvtierd's sessions
    "kvtier_client_options_init": (None, [ctypes.POINTER(ClientOptions)]),
    "kvtier_session_options_init": (None, [ctypes.POINTER(SessionOptions)]),
    "kvtier_connect": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ClientOptions),
                                      ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_client_free": (None, [ctypes.c_void_p]),
    "kvtier_open_session": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(SessionOptions),
                                           ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_reattach": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p,
                                       ctypes.POINTER(SessionOptions),
                                       ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_session_id": (ctypes.c_char_p, [ctypes.c_void_p]),
    "kvtier_num_tokens": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "kvtier_append": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int32]),
    "kvtier_decode": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, c_int32_p, c_int32_p,
                                     ctypes.c_size_t]),
    "kvtier_flush": (ctypes.c_int, [ctypes.c_void_p]),
    "kvtier_report_signals": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(StepSignals)]),
    "kvtier_observe_queries": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                              ctypes.c_int32, ctypes.c_int64]),
    "kvtier_close_session": (ctypes.c_int, [ctypes.c_void_p]),
    "kvtier_session_suspend": (ctypes.c_int, [ctypes.c_void_p]),
    "kvtier_session_free": (None, [ctypes.c_void_p]),
    # in-process
    "kvtier_version": (ctypes.c_char_p, []),
    "kvtier_abi_version": (ctypes.c_int32, []),
    "kvtier_last_error": (ctypes.c_char_p, []),
    "kvtier_sequence_options_init": (None, [ctypes.POINTER(SequenceOptions)]),
    "kvtier_device_create": (ctypes.c_int, [ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_device_free": (None, [ctypes.c_void_p]),
    "kvtier_device_kind": (ctypes.c_int32, [ctypes.c_void_p]),
    "kvtier_batch_create": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(Geometry),
                                           ctypes.POINTER(SequenceOptions), ctypes.c_int32,
                                           ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_batch_add": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_batch_max_batch": (ctypes.c_int32, [ctypes.c_void_p]),
    "kvtier_batch_begin_step": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32,
                                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                                               ctypes.c_void_p, ctypes.POINTER(WorkingSet)]),
    "kvtier_batch_attend": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32,
                                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]),
    "kvtier_batch_end_step": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                                             ctypes.c_void_p]),
    "kvtier_batch_synchronize": (ctypes.c_int, [ctypes.c_void_p]),
    "kvtier_batch_native_stream": (ctypes.c_int, [ctypes.c_void_p,
                                                  ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_batch_free": (None, [ctypes.c_void_p]),
    "kvtier_sequence_create": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(Geometry),
                                              ctypes.POINTER(SequenceOptions),
                                              ctypes.POINTER(ctypes.c_void_p)]),
    "kvtier_sequence_batch": (ctypes.c_void_p, [ctypes.c_void_p]),
    "kvtier_sequence_append": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_int32]),
    "kvtier_sequence_num_tokens": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "kvtier_sequence_decode": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_void_p]),
    "kvtier_sequence_wait": (ctypes.c_int, [ctypes.c_void_p]),
    "kvtier_sequence_report_signals": (ctypes.c_int, [ctypes.c_void_p,
                                                      ctypes.POINTER(StepSignals)]),
    "kvtier_sequence_observe_queries": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32,
                                                       ctypes.c_void_p, ctypes.c_int32,
                                                       ctypes.c_int64]),
    "kvtier_sequence_counter": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p,
                                               ctypes.POINTER(ctypes.c_int64)]),
    "kvtier_sequence_last_step": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, c_int32_p,
                                                 c_int32_p, c_int32_p, ctypes.c_size_t]),
    "kvtier_sequence_close": (ctypes.c_int, [ctypes.c_void_p]),
    "kvtier_sequence_free": (None, [ctypes.c_void_p]),
    "kvtier_counter_count": (ctypes.c_int32, []),
    "kvtier_counter_name": (ctypes.c_char_p, [ctypes.c_int32]),
}

_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()


def _candidates():
    env = os.environ.get("KVTIER_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    # <build>/client/python/kvtier -> <build>/libkvtier.so
    yield os.path.join(here, "..", "..", "..", "libkvtier.so")
    yield os.path.join(here, "libkvtier.so")
    found = ctypes.util.find_library("kvtier")
    if found:
        yield found


def lib() -> ctypes.CDLL:
    """The loaded library, its prototypes declared. OSError naming every place tried."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if os.path.sep in path and not os.path.exists(path):
                tried.append(path + " (absent)")
                continue
            try:
                loaded = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s (%s)" % (path, e))
                continue
            abi = getattr(loaded, "kvtier_abi_version", None)
            abi = abi() if abi is not None else 0  # before the C ABI had a version
            if abi != ABI_VERSION:
                tried.append("%s (C ABI %d; this package needs %d)" % (path, abi, ABI_VERSION))
                continue
            for name, (restype, argtypes) in _PROTOTYPES.items():
                fn = getattr(loaded, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _lib = loaded
            return _lib
        raise OSError("no usable libkvtier.so; set KVTIER_LIBRARY. Tried: " + "; ".join(tried))
