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


def read(path):
    """Reads a GGUF v3 file as gguf_write.write writes it (and llama.cpp's F32/F16 files):
    returns ({key: value}, {name: float32 numpy array in row-major [out][in]})."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version != 3:
        raise ValueError(f"{path}: GGUF version {version}, this reader reads 3")
    pos = 24

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode("utf-8")
        pos += n
        return s

    by_code = {code: fmt for code, fmt in _SCALAR.values()}

    def value(code):
        if code == _STRING:
            return string()
        if code == _ARRAY:
            el, n = take("<I"), take("<Q")
            return [value(el) for _ in range(n)]
        return take(by_code[code])

    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = take("<I")
        dims = [take("<Q") for _ in range(nd)]
        ty, off = take("<I"), take("<Q")
        infos.append((name, dims, ty, off))
    align = kv.get("general.alignment", ALIGNMENT)
    base = pos + (-pos) % align
    dtypes = {code: dt for code, dt in _TENSOR_TYPE.values()}
    tensors = {}
    for name, dims, ty, off in infos:
        if ty not in dtypes:
            raise ValueError(f"{path}: tensor {name} has type {ty}; this reader reads F32 and F16")
        count = int(np.prod(dims))
        arr = np.frombuffer(data, dtype=dtypes[ty], count=count, offset=base + off)
        tensors[name] = arr.reshape(list(reversed(dims))).astype(np.float32)
    return kv, tensors
