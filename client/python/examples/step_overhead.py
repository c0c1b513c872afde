"""How long one decode step of one layer takes through the Python package: the time of
``seq.decode(layer, q, out)`` per call, on the CPU device, for

  (a) the project's model shape: 6 layers, 8 query / 2 KV heads of 32, fp16, speculative,
      budget 2048, 4096 tokens appended per layer;
  (b) a Llama-8B-shaped layer: 32 query / 8 KV heads of 128, fp16, speculative, budget 2048,
      32768 tokens appended, one layer.

Every timed call follows an untimed append of one token to its layer, as a decoder's step
does. Queries drift as a decoder's do: q_t = a·q_{t−1} + sqrt(1 − a²)·noise per head
(a = --drift): cos(q_t, q_{t−1}) is about a, so the default 0.7 at τ = 0.7 corrects about
half the heads, near the 0.48 the project's model gives (docs/eval.md); 0.95 corrects almost
none, 0 almost all. Keys and values are random: the selection is not a model's.

Four variants, interleaved call by call: seq.decode with torch tensors, with numpy arrays,
the same native calls (kvtier_sequence_decode, then kvtier_batch_synchronize as the
package does on the CPU) made straight through ctypes with their arguments prepared outside
the timing (kvtier._native, the package's internal binding), and those two calls timed in
C++ (bench/native_step.cc, libkvtier_native_step.so in the build tree: the baseline the
ratios are taken against, free of Python's and ctypes' cost). It also times the package's
argument handling alone (kvtier.local._tensor for q and out: the checks and DLPack borrows a
decode call makes before it calls the library), which is what the package adds per call;
the native time is dominated by the step itself and varies more than that from call to call.

    PYTHONPATH=<build>/client/python python3 client/python/examples/step_overhead.py
    ... --shape tiny --steps 500        # one of the shapes, more steps
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np

import kvtier
from kvtier import _dlpack, _native
from kvtier import local as kvlocal

try:
    import torch
except ImportError:  # numpy inputs only
    torch = None

SHAPES = {
    "tiny": dict(layers=6, q_heads=8, kv_heads=2, head_dim=32, tokens=4096),
    "llama8b": dict(layers=1, q_heads=32, kv_heads=8, head_dim=128, tokens=32768),
}


def summary(us):
    us = sorted(us)
    return "mean %7.1f  median %7.1f  p90 %7.1f  min %7.1f µs  (%d calls)" % (
        statistics.fmean(us), us[len(us) // 2], us[int(len(us) * 0.9)], us[0], len(us))


def load_cpp(path):
    """libkvtier_native_step.so (bench/native_step.cc): the decode step timed in C++; None,
    and why on stderr, where it is not found."""
    candidates = [path] if path else [
        os.path.join(os.path.dirname(os.path.abspath(_native.lib()._name)),
                     "bench", "libkvtier_native_step.so"),
        os.path.join(os.path.dirname(os.path.abspath(_native.lib()._name)),
                     "libkvtier_native_step.so")]
    for c in candidates:
        if c and os.path.exists(c):
            cpp = ctypes.CDLL(c)
            cpp.kvtier_native_decode_timed.restype = ctypes.c_int
            cpp.kvtier_native_decode_timed.argtypes = [
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)]
            return cpp
    print("step_overhead: libkvtier_native_step.so not found (%s): no C++-timed baseline"
          % ", ".join(c for c in candidates if c), file=sys.stderr)
    return None


def run_shape(name, s, args, dev, cpp):
    L, Hq, Hkv, d, T = s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"], s["tokens"]
    T = args.tokens or T
    steps = args.steps or (500 if name == "tiny" else 150)
    page = 32
    total_steps = args.warmup + 4 * steps  # one call of each of (up to) four variants per step
    max_tokens = -(-(T + total_steps + page) // page) * page
    geo = kvtier.LocalGeometry(num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=d,
                               page_size=page, dtype="float16")
    opts = kvtier.SequenceOptions(mode=args.mode, budget_tokens=args.budget,
                                  max_tokens=max_tokens, tau=args.tau)
    seq = kvtier.Sequence(dev, geo, opts)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    chunk = 4096
    for layer in range(L):
        for s0 in range(0, T, chunk):
            n = min(chunk, T - s0)
            k = rng.standard_normal((n, Hkv, d), dtype=np.float32).astype(np.float16)
            v = rng.standard_normal((n, Hkv, d), dtype=np.float32).astype(np.float16)
            seq.append(layer, k, v)
    prefill_s = time.perf_counter() - t0

    a = args.drift
    q = [rng.standard_normal((Hq, d), dtype=np.float32) for _ in range(L)]
    one_k = rng.standard_normal((1, Hkv, d), dtype=np.float32).astype(np.float16)

    def next_q(layer):
        noise = rng.standard_normal((Hq, d), dtype=np.float32)
        q[layer] = a * q[layer] + np.sqrt(1 - a * a) * noise
        return q[layer].astype(np.float16)

    lib = _native.lib()
    h, batch = seq._h, seq.batch._h

    def call(kind, layer, times):
        seq.append(layer, one_k, one_k)
        qn = next_q(layer)
        if kind == "torch":
            qt = torch.from_numpy(qn)
            out = torch.empty_like(qt)
            t = time.perf_counter()
            seq.decode(layer, qt, out)
            dt = time.perf_counter() - t
        elif kind == "numpy":
            out = np.empty_like(qn)
            t = time.perf_counter()
            seq.decode(layer, qn, out)
            dt = time.perf_counter() - t
        elif kind == "cpp":  # the same two calls timed in C++ (libkvtier_native_step)
            out = np.empty_like(qn)
            qp, op = _dlpack.borrow(qn), _dlpack.borrow(out)
            us = ctypes.c_double()
            rc = cpp.kvtier_native_decode_timed(h, batch, layer, qp.ptr, op.ptr, ctypes.byref(us))
            if rc:
                raise RuntimeError(lib.kvtier_last_error().decode())
            dt = us.value * 1e-6
        else:  # the native calls alone, their arguments prepared outside the timing
            out = np.empty_like(qn)
            qp, op = _dlpack.borrow(qn), _dlpack.borrow(out)
            t = time.perf_counter()
            rc = lib.kvtier_sequence_decode(h, layer, qp.ptr, op.ptr, None)
            rc2 = lib.kvtier_batch_synchronize(batch)  # as the package does on the CPU
            dt = time.perf_counter() - t
            if rc or rc2:
                raise RuntimeError(lib.kvtier_last_error().decode())
        if times is not None:
            times.append(dt * 1e6)

    kinds = (["torch"] if torch is not None else []) + ["numpy", "native"] + \
        (["cpp"] if cpp is not None else [])
    for _ in range(args.warmup):
        for layer in range(L):
            call(kinds[0], layer, None)
    # The variants interleaved (each step of each layer: one call of each, in a rotating
    # order), so that drift in the machine's speed falls on all of them alike.
    results = {kind: [] for kind in kinds}
    for i in range(steps):
        for layer in range(L):
            for j in range(len(kinds)):
                kind = kinds[(i + j) % len(kinds)]
                call(kind, layer, results[kind])
    # The package's own work per call without the native call: the two tensors' checks and
    # DLPack borrows (kvtier.local._tensor, what decode does before it calls the library).
    wrap = {}
    for kind in [k for k in kinds if k in ("torch", "numpy")]:
        qn = next_q(0)
        qx = torch.from_numpy(qn) if kind == "torch" else qn
        ox = torch.empty_like(qx) if kind == "torch" else np.empty_like(qn)
        times = []
        for _ in range(2000):
            t = time.perf_counter()
            kvlocal._tensor("q", qx, (Hq, d), "float16", dev)
            kvlocal._tensor("out", ox, (Hq, d), "float16", dev, writable=True)
            times.append((time.perf_counter() - t) * 1e6)
        wrap[kind] = times
    seq.wait()
    st = seq.stats()
    rate = seq.correction_rate()
    print("(%s) %d layer(s), %d/%d heads of %d, fp16, %s, budget %d, %d tokens appended per "
          "layer (%.1f s), %d steps per variant" % (name, L, Hq, Hkv, d, args.mode, args.budget, T,
                                                    prefill_s, steps))
    for kind in kinds:
        label = {"torch": "seq.decode, torch", "numpy": "seq.decode, numpy",
                 "native": "native calls (ctypes)", "cpp": "native calls (C++ timed)"}[kind]
        print("  %-24s %s" % (label, summary(results[kind])))
    if cpp is not None:
        base = statistics.median(results["cpp"])
        print("  median against C++: " + ", ".join(
            "%s %.2fx" % (kind, statistics.median(results[kind]) / base)
            for kind in kinds if kind != "cpp"))
    for kind, times in wrap.items():
        print("  %-24s %s" % ("argument handling, " + kind, summary(times)))
    print("  correction rate %.3f (%d of %d KV heads), recalled pages %d" % (
        rate, st["corrected_heads"], st["checked_heads"], st.get("recalled_pages", 0)))
    seq.close()  # freed as this returns, before the device


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["all"] + sorted(SHAPES), default="all")
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps (default 500 tiny, 150 llama8b)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=0, help="tokens appended (default: the shape's)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--mode", default="speculative")
    ap.add_argument("--tau", type=float, default=0.7)
    ap.add_argument("--drift", type=float, default=0.7, help="query autocorrelation a in [0, 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--native-step", help="libkvtier_native_step.so (default: beside "
                    "libkvtier.so in the build tree, <build>/bench/)")
    args = ap.parse_args(argv)
    if torch is not None and args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = kvtier.Device("cpu")
    cpp = load_cpp(args.native_step)
    for name in (sorted(SHAPES, reverse=True) if args.shape == "all" else [args.shape]):
        run_shape(name, SHAPES[name], args, dev, cpp)
    del dev
    return 0


if __name__ == "__main__":
    sys.exit(main())
