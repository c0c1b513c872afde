"""DLPack without a compiled module: reading the tensors callers pass (anything with
``__dlpack__``: torch, numpy, CuPy, JAX) and handing out views of kvtier's memory that any of
them can take with ``from_dlpack``. The structs are those of dlpack.h (the unversioned
``dltensor`` capsule every framework since 2021 produces and accepts).

Inputs are borrowed, never copied: the capsule is kept alive for the call and released
after, so the producer's deleter runs as it would for any consumer that did not keep it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Sequence, Tuple

# DLDeviceType
CPU = 1
CUDA = 2
CUDA_HOST = 3
# DLDataTypeCode
_INT, _UINT, _FLOAT, _BFLOAT = 0, 1, 2, 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# dtype names <-> (code, bits)
DTYPES = {"float16": (_FLOAT, 16), "bfloat16": (_BFLOAT, 16), "float32": (_FLOAT, 32),
          "int32": (_INT, 32), "int64": (_INT, 64), "uint8": (_UINT, 8), "int8": (_INT, 8)}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(code: int, bits: int) -> str:
    return _NAMES.get((code, bits), "code %d/%d bits" % (code, bits))


class Borrowed:
    """A tensor a caller passed, as kvtier reads it: its address, shape, dtype and device.
    Holds the producer's capsule (or buffer) until released."""

    __slots__ = ("ptr", "shape", "dtype", "device_type", "device_id", "contiguous", "_keep")

    def __init__(self, ptr, shape, dtype, device_type, device_id, contiguous, keep):
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.device_type = device_type
        self.device_id = device_id
        self.contiguous = contiguous
        self._keep = keep


def _contiguous(shape: Sequence[int], strides: Optional[Sequence[int]]) -> bool:
    if strides is None:
        return True
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def borrow(obj: Any, stream: Optional[int] = None) -> Borrowed:
    """Reads `obj` (``__dlpack__``, or a writable or read-only buffer such as bytes, bytearray,
    array.array or a memoryview). Raises TypeError for anything else."""
    if hasattr(obj, "__dlpack__"):
        try:
            capsule = obj.__dlpack__(stream=stream) if stream is not None else obj.__dlpack__()
        except TypeError:
            capsule = obj.__dlpack__()
        if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
            raise TypeError("__dlpack__ did not return a 'dltensor' capsule")
        managed = ctypes.cast(_api.PyCapsule_GetPointer(capsule, b"dltensor"),
                              ctypes.POINTER(DLManagedTensor)).contents
        t = managed.dl_tensor
        shape = tuple(t.shape[i] for i in range(t.ndim))
        strides = None if not t.strides else tuple(t.strides[i] for i in range(t.ndim))
        ptr = (t.data or 0) + t.byte_offset
        return Borrowed(ptr, shape, dtype_name(t.dtype.code, t.dtype.bits) if t.dtype.lanes == 1
                        else "vector", t.device.device_type, t.device.device_id,
                        _contiguous(shape, strides), capsule)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError("expected a tensor with __dlpack__ (torch, numpy, CuPy) or a buffer, got %s"
                        % type(obj).__name__) from None
    fmt = {"e": "float16", "f": "float32", "i": "int32", "l": "int64", "q": "int64",
           "B": "uint8", "b": "int8"}.get(view.format.lstrip("@=<"), "bytes")
    if view.readonly:
        # bytes: its storage, read in place (kvtier only reads inputs).
        if not isinstance(view.obj, bytes) or view.nbytes != len(view.obj):
            raise TypeError("a read-only buffer other than a whole bytes object: pass a "
                            "writable buffer or a tensor")
        c = ctypes.c_char_p(view.obj)
        ptr = ctypes.cast(c, ctypes.c_void_p).value
        keep = (view, c)
    else:
        arr = (ctypes.c_char * view.nbytes).from_buffer(view)
        ptr = ctypes.addressof(arr)
        keep = (view, arr)
    return Borrowed(ptr, tuple(view.shape), fmt, CPU, 0, view.c_contiguous, keep)


# Views handed out: each DLManagedTensor and what keeps its memory alive, until the consumer
# calls the deleter.
_lock = threading.Lock()
_live = {}


@_Deleter
def _delete(managed_ptr):
    with _lock:
        _live.pop(ctypes.addressof(managed_ptr.contents), None)


class View:
    """kvtier memory (a working set's K or V cache, a slot table) as a DLPack producer:
    ``torch.from_dlpack(view)``, ``numpy.from_dlpack(view)``. Valid while `owner` holds the
    memory (a step's views: until that member's next step of the layer)."""

    def __init__(self, ptr: int, shape: Tuple[int, ...], dtype: str, device_type: int,
                 device_id: int, owner: Any):
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype
        self.device_type, self.device_id, self._owner = device_type, device_id, owner

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (self.device_type, self.device_id)

    def __dlpack__(self, stream: Any = None, **_: Any):
        n = len(self.shape)
        managed = DLManagedTensor()
        shape = (ctypes.c_int64 * max(n, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(n, 1))()
        step = 1
        for i in reversed(range(n)):
            strides[i] = step
            step *= self.shape[i]
        code, bits = DTYPES[self.dtype]
        managed.dl_tensor.data = self.ptr
        managed.dl_tensor.device = DLDevice(self.device_type, self.device_id)
        managed.dl_tensor.ndim = n
        managed.dl_tensor.dtype = DLDataType(code, bits, 1)
        managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        managed.dl_tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        managed.dl_tensor.byte_offset = 0
        managed.deleter = _delete
        address = ctypes.addressof(managed)
        with _lock:
            _live[address] = (managed, shape, strides, self._owner)
        return _api.PyCapsule_New(address, b"dltensor", None)

    def __repr__(self) -> str:
        return "kvtier.View(shape=%s, dtype=%s, device=%s)" % (
            self.shape, self.dtype, self.__dlpack_device__())
