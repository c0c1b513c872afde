"""A GGUF (version 3) reader in pure Python and numpy: the metadata and the F32/F16 tensors
of a model file, the tensors memory-mapped (nothing is copied until the caller converts).

    from kvtier import gguf
    metadata, tensors = gguf.read("engine/model/kvtier-tiny.gguf")
    metadata["llama.rope.freq_base"]          # 500000.0
    tensors["blk.0.attn_q.weight"].shape      # (256, 256): row-major [out][in], float16

GGUF lists a tensor's dimensions innermost first (ne = (in, out) for a matrix that maps `in`
to `out`); the arrays here have numpy's row-major shape, the reverse: (out, in). They are
read-only views of the file (numpy.frombuffer over an mmap) in the file's own dtype
(float32 or float16); `.astype(numpy.float32)` makes a private copy. Tensors of any other
type (quantised blocks, BF16, integers) raise ValueError naming the tensor and its type, as
do a bad magic, an unsupported version, a file cut short and a header that does not add up.

The format (little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count; the
metadata as (string key, u32 type, value); the tensor infos as (string name, u32 n_dims,
u64 ne[n_dims], u32 ggml type, u64 offset); then, at the next multiple of
`general.alignment` (default 32), the data, each tensor at its offset from there. Strings are
a u64 byte count and UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, Dict, List, Tuple

import numpy as np

__all__ = ["read", "GGML_TYPE_NAMES", "DEFAULT_ALIGNMENT"]

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# Metadata value types.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                 10: "<u8", 11: "<i8", 12: "<f8"}

# ggml tensor types (ggml.h), for the error naming a type this reader does not read.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0",
}
_READABLE = {0: np.dtype("<f4"), 1: np.dtype("<f2")}


class _Cursor:
    """Reads the header from the mapped file, refusing to read past its end."""

    def __init__(self, path: str, buf: Any, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ValueError("%s: truncated GGUF file: %s needs %d bytes at offset %d, the file "
                             "has %d" % (self.path, what, n, self.pos, self.size))

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what + " (length)")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError("%s: %s is not UTF-8 (%s)" % (self.path, what, e)) from None

    def value(self, code: int, what: str) -> Any:
        if code in _SCALARS:
            return self.unpack(_SCALARS[code], what)
        if code == _STRING:
            return self.string(what)
        if code == _ARRAY:
            el, n = self.unpack("<I", what + " (array type)"), self.unpack("<Q", what + " (count)")
            if el in _ARRAY_DTYPES:
                dt = np.dtype(_ARRAY_DTYPES[el])
                self.need(n * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            if el == 7:  # bool
                self.need(n, what)
                out = [b != 0 for b in self.buf[self.pos:self.pos + n]]
                self.pos += n
                return out
            if el not in (_STRING, _ARRAY):
                raise ValueError("%s: %s: unknown array element type %d" % (self.path, what, el))
            # Each element takes at least 8 bytes (a string's or an array's count).
            self.need(min(n, self.size) * 8, what)
            return [self.value(el, "%s[%d]" % (what, i)) for i in range(n)]
        raise ValueError("%s: %s: unknown metadata value type %d" % (self.path, what, code))


def read(path: str) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """Reads a GGUF v3 file: ({key: value}, {name: array}). Values are int, float, bool, str
    or lists of them; arrays are read-only memory-mapped views, row-major (the reverse of
    GGUF's dimension order), float32 or float16 as stored."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 4:
            raise ValueError("%s: not a GGUF file (%d bytes)" % (path, size))
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(path, buf, size)
    magic = buf[0:4]
    if magic != MAGIC:
        raise ValueError("%s: not a GGUF file (magic %r, expected %r)" % (path, magic, MAGIC))
    c.pos = 4
    version = c.unpack("<I", "the version")
    if version != VERSION:
        if version == int.from_bytes(struct.pack("<I", VERSION), "big"):
            raise ValueError("%s: a big-endian GGUF file; this reader reads little-endian" % path)
        raise ValueError("%s: GGUF version %d; this reader reads version %d" %
                         (path, version, VERSION))
    n_tensors = c.unpack("<Q", "the tensor count")
    n_kv = c.unpack("<Q", "the metadata count")
    # Every entry takes more than 8 bytes: counts past the file's size are corrupt.
    if n_tensors > size // 8 or n_kv > size // 8:
        raise ValueError("%s: corrupt GGUF header: %d tensors and %d metadata entries in %d "
                         "bytes" % (path, n_tensors, n_kv, size))
    metadata: Dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string("metadata key %d" % i)
        code = c.unpack("<I", "the type of metadata %r" % key)
        metadata[key] = c.value(code, "metadata %r" % key)
    infos: List[Tuple[str, List[int], int, int]] = []
    for i in range(n_tensors):
        name = c.string("tensor name %d" % i)
        nd = c.unpack("<I", "the rank of tensor %r" % name)
        if nd < 1 or nd > MAX_DIMS:
            raise ValueError("%s: tensor %r has %d dimensions; GGUF allows 1 to %d" %
                             (path, name, nd, MAX_DIMS))
        ne = [c.unpack("<Q", "the dimensions of tensor %r" % name) for _ in range(nd)]
        ty = c.unpack("<I", "the type of tensor %r" % name)
        off = c.unpack("<Q", "the offset of tensor %r" % name)
        infos.append((name, ne, ty, off))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ValueError("%s: general.alignment = %r: must be a power of two" % (path, align))
    base = c.pos + (-c.pos) % align
    tensors: Dict[str, np.ndarray] = {}
    for name, ne, ty, off in infos:
        if ty not in _READABLE:
            raise ValueError("%s: tensor %r has type %s (%d); this reader reads F32 and F16" %
                             (path, name, GGML_TYPE_NAMES.get(ty, "unknown"), ty))
        if name in tensors:
            raise ValueError("%s: tensor %r appears twice" % (path, name))
        if off % align:
            raise ValueError("%s: tensor %r at offset %d is not aligned to %d" %
                             (path, name, off, align))
        dt = _READABLE[ty]
        count = 1
        for n in ne:
            count *= n
        start, nbytes = base + off, count * dt.itemsize
        if start + nbytes > size:
            raise ValueError("%s: truncated GGUF file: tensor %r (%s, ne %s) needs bytes [%d, %d), "
                             "the file has %d" % (path, name, GGML_TYPE_NAMES[ty], ne, start,
                                                  start + nbytes, size))
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=start)
        tensors[name] = arr.reshape(tuple(reversed(ne)))
    return metadata, tensors


if __name__ == "__main__":  # python -m kvtier.gguf FILE: the metadata and tensor shapes
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvtier.gguf FILE.gguf")
    meta, ts = read(sys.argv[1])
    for k, v in meta.items():
        if isinstance(v, list) and len(v) > 8:
            v = "[%d values: %s ...]" % (len(v), ", ".join(repr(x) for x in v[:4]))
        print("%s = %s" % (k, v))
    for k, a in ts.items():
        print("%s %s %s" % (k, a.dtype, list(a.shape)))
