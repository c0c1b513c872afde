"""A minimal GGUF (version 3) writer for train.py: metadata and F32/F16 tensors."""
import struct

import numpy as np

ALIGNMENT = 32
_SCALAR = {"u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"),
           "u32": (4, "<I"), "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<?"),
           "u64": (10, "<Q"), "i64": (11, "<q"), "f64": (12, "<d")}
_STRING, _ARRAY = 8, 9
_TENSOR_TYPE = {"f32": (0, np.float32), "f16": (1, np.float16)}


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(kind, v):
    if kind == "str":
        return struct.pack("<I", _STRING) + _str(v)
    if kind.startswith("arr_"):
        el = kind[4:]
        if el == "str":
            return struct.pack("<IIQ", _ARRAY, _STRING, len(v)) + b"".join(_str(x) for x in v)
        code, fmt = _SCALAR[el]
        return struct.pack("<IIQ", _ARRAY, code, len(v)) + b"".join(struct.pack(fmt, x) for x in v)
    code, fmt = _SCALAR[kind]
    return struct.pack("<I", code) + struct.pack(fmt, v)


def write(path, kv, tensors):
    """kv: [(key, kind, value)]; tensors: [(name, numpy array in row-major [out][in], type)].
    GGUF lists dimensions innermost first, so a [out][in] matrix has ne = (in, out)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, kind, v in kv:
        head += _str(key) + _value(kind, v)
    offset = 0
    blobs = []
    for name, arr, ty in tensors:
        code, dt = _TENSOR_TYPE[ty]
        data = np.ascontiguousarray(arr.astype(dt)).tobytes()
        dims = list(reversed(arr.shape))
        head += _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", code, offset)
        blobs.append(data)
        offset += len(data)
        offset += (-offset) % ALIGNMENT
    with open(path, "wb") as f:
        f.write(head)
        f.write(b"\0" * ((-len(head)) % ALIGNMENT))
        for data in blobs:
            f.write(data)
            f.write(b"\0" * ((-len(data)) % ALIGNMENT))
