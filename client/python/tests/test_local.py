"""kvtier.local: the in-process data path from Python over libkvtier's C API, on the CPU.

Needs the package and the library, from the environment (ctest sets both):
  KVTIER_PYTHONPATH  the package root (<build>/client/python)
  KVTIER_LIBRARY     libkvtier.so (else the package finds the build tree's)
and numpy; the torch tests run where torch is importable. Without the package every test is
skipped.
"""

from __future__ import annotations

import os
import sys
import threading
import types
import unittest

import _support  # the package on the path

kvtier, IMPORT_ERROR = _support.load_kvtier("numpy")
if kvtier is not None:
    import numpy as np

    from kvtier import local as kvlocal

try:
    import torch
except ImportError:
    torch = None

SMALL = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8)


def reference_attention(q, keys, values, group):
    """q [Hq][d]; keys/values [Hkv] lists of [t][d] arrays (the tokens each head attends)."""
    out = np.zeros(q.shape, dtype=np.float64)
    for h in range(q.shape[0]):
        k = keys[h // group].astype(np.float64)
        v = values[h // group].astype(np.float64)
        s = k @ q[h].astype(np.float64) / np.sqrt(q.shape[1])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v
    return out


@unittest.skipIf(kvtier is None, "kvtier not importable: %s" % IMPORT_ERROR)
class LocalTest(unittest.TestCase):
    def setUp(self):
        self.dev = kvtier.Device("cpu")
        self.rng = np.random.default_rng(7)

    def geometry(self, dtype="float32"):
        return kvtier.LocalGeometry(dtype=dtype, **SMALL)

    def kv(self, n, dtype=np.float32):
        k = self.rng.standard_normal((n, SMALL["num_kv_heads"], SMALL["head_dim"])).astype(dtype)
        v = self.rng.standard_normal((n, SMALL["num_kv_heads"], SMALL["head_dim"])).astype(dtype)
        return k, v

    def q(self, dtype=np.float32, n=None):
        shape = (SMALL["num_q_heads"], SMALL["head_dim"]) if n is None else (
            n, SMALL["num_q_heads"], SMALL["head_dim"])
        return self.rng.standard_normal(shape).astype(dtype)

    def test_struct_mirrors_match_the_library(self):
        # The ctypes mirrors of the option structs are the C structs' size (each _init writes
        # its sizeof into struct_size), and the library loaded speaks the package's C ABI.
        from kvtier import _native
        lib = _native.lib()
        self.assertEqual(lib.kvtier_abi_version(), _native.ABI_VERSION)
        for cls, init in ((_native.SequenceOptions, lib.kvtier_sequence_options_init),
                          (_native.SessionOptions, lib.kvtier_session_options_init),
                          (_native.ClientOptions, lib.kvtier_client_options_init)):
            o = cls()
            init(o)
            self.assertEqual(o.struct_size, _native.ctypes.sizeof(cls), cls.__name__)

    def test_full_mode_equals_dense_attention(self):
        g = self.geometry()
        seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="full", max_tokens=512))
        k, v = self.kv(77)
        for layer in range(g.num_layers):
            seq.append(layer, k, v)
        self.assertEqual(seq.num_tokens(0), 77)
        for step in range(3):
            q = self.q()
            out = np.zeros_like(q)
            lse = np.zeros(g.num_q_heads, np.float32)
            seq.decode(0, q, out, lse)
            want = reference_attention(q, [k[:, h] for h in range(2)], [v[:, h] for h in range(2)], 2)
            np.testing.assert_allclose(out, want, atol=1e-5)
            self.assertTrue(np.all(np.isfinite(lse)))
        self.assertEqual(seq.stats()["steps"], 3)

    def test_working_set_views_hold_the_tokens_their_tables_name(self):
        # Speculative mode, stepped batch-first through the sequence's batch of one: every
        # slot a view's table names holds that page's K and V, and kvtier's attention equals
        # attention over exactly those tokens.
        g = self.geometry()
        o = kvtier.SequenceOptions(mode="speculative", budget_tokens=4 * 8, max_tokens=512)
        seq = kvtier.Sequence(self.dev, g, o)
        self.assertEqual(seq.batch.max_batch, 1)
        k, v = self.kv(150)
        for layer in range(g.num_layers):
            seq.append(layer, k, v)
        keys, values = [k], [v]
        p = g.page_size
        for step in range(6):
            kk, vv = np.concatenate(keys), np.concatenate(values)
            q = self.q()
            for layer in range(g.num_layers):
                view = seq.batch.begin_step(layer, [seq], q)[0]
                out = np.zeros_like(q)
                seq.batch.attend(layer, [seq], q, out)
                kc = np.from_dlpack(view.k_cache)
                vc = np.from_dlpack(view.v_cache)
                table = np.from_dlpack(view.slot_table)
                self.assertEqual(kc.shape, (view.num_slots, p, 2, 16))
                self.assertEqual(table.shape, (2, view.num_slots))
                self.assertEqual(view.num_tokens, kk.shape[0])
                held_k, held_v = [], []
                for h in range(2):
                    tokens = []
                    for s in range(view.num_slots):
                        page = int(table[h, s])
                        if page < 0:
                            continue
                        n = min(p, view.num_tokens - page * p)
                        np.testing.assert_array_equal(kc[s, :n, h], kk[page * p:page * p + n, h])
                        np.testing.assert_array_equal(vc[s, :n, h], vv[page * p:page * p + n, h])
                        tokens.extend(range(page * p, page * p + n))
                    self.assertLessEqual(len(tokens), 4 * p + p)  # the budget (+ the page filling)
                    held_k.append(kk[tokens, h])
                    held_v.append(vv[tokens, h])
                np.testing.assert_allclose(out, reference_attention(q, held_k, held_v, 2),
                                           atol=1e-5)
                seq.batch.end_step(layer, [seq], q)
            nk, nv = self.kv(1 + step % 3)
            for layer in range(g.num_layers):
                seq.append(layer, nk, nv)
            keys.append(nk)
            values.append(nv)
        seq.wait()
        st = seq.stats()
        self.assertEqual(st["steps"], 6 * g.num_layers)
        self.assertGreater(st["checked_heads"], 0)
        self.assertGreater(st["recalled_pages"], 0)
        corrected, table = seq.last_step(0)
        self.assertEqual(len(table), 2)
        self.assertGreaterEqual(corrected, 0)

    def test_a_batch_of_two_equals_two_sequences_alone(self):
        g = self.geometry(dtype="float16")
        o = kvtier.SequenceOptions(mode="speculative", budget_tokens=32, max_tokens=512)
        batch = kvtier.Batch(self.dev, g, o, max_batch=2)
        members = [batch.add(), batch.add()]
        alone = [kvtier.Sequence(self.dev, g, o) for _ in range(2)]
        with self.assertRaises(kvtier.Error) as full:
            batch.add()
        self.assertEqual(full.exception.code, "RESOURCE_EXHAUSTED")
        for i, n in enumerate((120, 83)):
            k, v = self.kv(n, np.float16)
            for layer in range(g.num_layers):
                members[i].append(layer, k, v)
                alone[i].append(layer, k, v)
        for step in range(5):
            q = self.q(np.float16, n=2)
            out = np.zeros_like(q)
            for layer in range(g.num_layers):
                batch.begin_step(layer, members, q)
                batch.attend(layer, members, q, out)
                batch.end_step(layer, members, q)
                for i in range(2):
                    mine = np.zeros_like(q[i])
                    alone[i].decode(layer, q[i], mine)
                    np.testing.assert_array_equal(out[i], mine)
        for m, a in zip(members, alone):
            m.wait()
            a.wait()
            self.assertEqual(m.stats()["recalled_pages"], a.stats()["recalled_pages"])

    def test_buffers_without_dlpack(self):
        g = self.geometry()
        seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="full", max_tokens=64))
        k, v = self.kv(9)
        # Typed buffers (the buffer protocol's format and shape say what they hold).
        kb = memoryview(bytearray(k.tobytes())).cast("B").cast("f", k.shape)
        vb = memoryview(bytearray(v.tobytes())).cast("B").cast("f", v.shape)
        seq.append(0, kb, vb)
        self.assertEqual(seq.num_tokens(0), 9)
        # Bytes say nothing of their type: refused, not reinterpreted.
        with self.assertRaises(kvtier.Error) as e:
            seq.append(0, bytearray(k.tobytes()), vb)
        self.assertIn("got uint8 [1152]", e.exception.message)

    def test_bad_tensors_name_the_argument_and_what_was_expected(self):
        g = self.geometry()
        seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="full", max_tokens=64))
        k, v = self.kv(5)
        seq.append(0, k, v)
        q, out = self.q(), np.zeros((4, 16), np.float32)
        cases = [
            ("q", lambda: seq.decode(0, q.astype(np.float16), out), "float32"),
            ("q", lambda: seq.decode(0, q[:3], out), "[4, 16]"),
            ("out", lambda: seq.decode(0, q, np.zeros((8, 16), np.float32)[::2]), "not contiguous"),
            ("k", lambda: seq.append(0, k[:, :1], v), "[n, 2, 16]"),
            ("v", lambda: seq.append(0, k, v[:4]), "[5, 2, 16]"),
            ("q", lambda: seq.decode(0, [[0.0] * 16] * 4, out), "__dlpack__"),
        ]
        for name, call, says in cases:
            with self.subTest(name=name, says=says):
                with self.assertRaises(kvtier.Error) as e:
                    call()
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn(name + ":", e.exception.message)
                self.assertIn(says, e.exception.message)
        self.assertEqual(seq.num_tokens(0), 5, "nothing of a refused call is kept")

    def test_bad_options_and_limits_get_the_library_s_answer(self):
        g = self.geometry()
        with self.assertRaises(kvtier.Error) as e:
            kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="fast"))
        self.assertIn("mode = 'fast'", e.exception.message)
        with self.assertRaises(kvtier.Error) as e:
            kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(budget_tokens=100, max_tokens=64))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("budget_tokens = 100", e.exception.message)
        with self.assertRaises(kvtier.Error) as e:
            kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(max_loss=1.5, budget_tokens=32,
                                                                max_tokens=64))
        self.assertIn("correction_max_loss = 1.5", e.exception.message)
        # a split is both parts or neither (the C API's split flag takes both)
        with self.assertRaises(ValueError) as ve:
            kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(sink_pages=1, budget_tokens=32,
                                                                max_tokens=64))
        self.assertIn("give both", str(ve.exception))
        seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="full", max_tokens=16))
        k, v = self.kv(17)
        with self.assertRaises(kvtier.Error) as e:
            seq.append(0, k, v)
        self.assertEqual(e.exception.code, "OUT_OF_RANGE")
        with self.assertRaises(kvtier.Error) as e:
            kvtier.Device("tpu")
        self.assertIn("kind = 'tpu'", e.exception.message)
        seq.close()
        with self.assertRaises(kvtier.Error) as e:
            seq.append(0, k[:1], v[:1])
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")

    def test_drop_policies_keep_the_heavy_hitter_the_window_loses(self):
        # Drop mode with a budget of 8 pages: page 3 holds the keys every query attends to.
        # The sliding window keeps the sinks and the newest pages and loses it; H2O and Conf-KV's
        # attention ranker, fed the prompt's last queries (observe_queries) and the decode
        # steps' attention, keep it for every KV head, evicting others instead.
        g = self.geometry()
        u = self.rng.standard_normal(SMALL["head_dim"]).astype(np.float32)
        u /= np.linalg.norm(u)
        n, hkv, d = 200, SMALL["num_kv_heads"], SMALL["head_dim"]
        k = 0.3 * self.rng.standard_normal((n, hkv, d)).astype(np.float32)
        v = self.rng.standard_normal((n, hkv, d)).astype(np.float32)
        k[24:32] += 6 * u
        observed = np.tile(4 * u, (8, SMALL["num_q_heads"], 1)).astype(np.float32)
        q = np.tile(4 * u, (SMALL["num_q_heads"], 1)).astype(np.float32)
        out = np.zeros((SMALL["num_q_heads"], d), np.float32)
        kept = {}
        for residency in ("none", "h2o", "attention"):
            seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(
                mode="drop", budget_tokens=64, max_tokens=512, residency_policy=residency))
            for layer in range(g.num_layers):
                seq.append(layer, k, v)
                seq.observe_queries(layer, observed, n - 8)
            for _ in range(4):
                for layer in range(g.num_layers):
                    seq.append(layer, *self.kv(1))
                    seq.decode(layer, q, out)
            seq.wait()
            _, table = seq.last_step(0)
            kept[residency] = [3 in row for row in table]
            stats = seq.stats()
            if residency == "none":
                self.assertEqual(stats["evicted_head_pages"], 0)
            else:
                self.assertGreater(stats["evicted_head_pages"], 0, residency)
            self.assertLessEqual(stats["resident_head_pages"], 8 * hkv * g.num_layers)
            seq.close()
        self.assertEqual(kept, {"none": [False] * hkv, "h2o": [True] * hkv,
                                "attention": [True] * hkv})

    def test_signals_reach_the_policies_and_bad_ones_are_refused(self):
        g = self.geometry()
        seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(
            mode="drop", budget_tokens=64, max_tokens=512, residency_policy="epiphany",
            budget_policy="confidence"))
        n = 100
        for layer in range(g.num_layers):
            seq.append(layer, *self.kv(n))
        delta = np.abs(self.rng.standard_normal((n, g.num_layers))).astype(np.float32)
        logits = self.rng.standard_normal(50).astype(np.float32)
        seq.report_signals(0, n, logits=logits, hidden_delta=delta)
        out = np.zeros((SMALL["num_q_heads"], SMALL["head_dim"]), np.float32)
        for t in range(3):
            for layer in range(g.num_layers):
                seq.append(layer, *self.kv(1))
                seq.decode(layer, self.q(), out)
            seq.report_signals(n + t, 1, logits=logits, hidden_delta=delta[:1])
        seq.wait()
        self.assertGreater(seq.stats()["evicted_head_pages"], 0)
        for call, name in (
                (lambda: seq.report_signals(0, 2, hidden_delta=delta[:3]), "hidden_delta"),
                (lambda: seq.report_signals(0, 1, logits=logits.astype(np.float64)), "logits"),
                (lambda: seq.report_signals(0, 1, hidden_delta=delta[0]), "hidden_delta")):
            with self.subTest(name=name):
                with self.assertRaises(kvtier.Error) as e:
                    call()
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn(name, e.exception.message)
        # What the library itself checks comes back with its message.
        with self.assertRaises(kvtier.Error) as e:
            seq.report_signals(-1, 1, logits=logits)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("first_position = -1", e.exception.message)
        seq.close()

    def test_a_default_cuda_stream_is_refused_not_replaced(self):
        # torch's default stream hands out cuda_stream 0; kvtier cannot adopt it, and making
        # its own stream instead would leave its work unordered with the caller's.
        for handle in (0, 1, 2, types.SimpleNamespace(cuda_stream=0)):
            with self.assertRaises(kvtier.Error) as e:
                kvtier.Sequence(self.dev, self.geometry(),
                                kvtier.SequenceOptions(mode="full", stream=handle))
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
            self.assertIn("a default CUDA stream", e.exception.message)

    def test_every_case_of_the_option_table_is_answered_as_the_table_says(self):
        # The one-option table (tests/include/option_table.toml) in-process from Python: the
        # C API hands the options to the library's resolver (and the policies to their
        # registry), so every case is accepted or refused with exactly the message every
        # other entry point gives.
        import tomllib

        path = os.environ.get("KVTIER_OPTION_TABLE") or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "include",
            "option_table.toml")
        with open(path, "rb") as f:
            table = tomllib.load(f)
        cases = [dict(table["base"], **case) for case in table["case"]]
        self.assertTrue(any("error" in c for c in cases) and any("error" not in c for c in cases))
        for c in cases:
            with self.subTest(case=c["name"]):
                g = kvtier.LocalGeometry(num_layers=1, num_q_heads=8, num_kv_heads=2,
                                         head_dim=64, page_size=c["page_size"])
                o = kvtier.SequenceOptions(mode=c["mode"], budget_tokens=c["budget_tokens"],
                                           max_tokens=c["max_tokens"],
                                           tau=c["correction_threshold"],
                                           trigger=c["correction_trigger"],
                                           max_loss=c["correction_max_loss"],
                                           summary=c["summary"],
                                           sink_pages=c.get("sink_pages"),
                                           recent_pages=c.get("recent_pages"),
                                           budget_policy=c["budget_policy"],
                                           residency_policy=c["residency_policy"],
                                           host_drop=c["host_drop"],
                                           policy_params=c.get("policy_params", {}))
                if "error" not in c:
                    kvtier.Sequence(self.dev, g, o).close()
                    continue
                with self.assertRaises(kvtier.Error) as e:
                    kvtier.Sequence(self.dev, g, o)
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertEqual(e.exception.message, c["error"])

    def test_stats_are_the_library_s_counters(self):
        g = self.geometry()
        seq = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="full", max_tokens=64))
        names = list(seq.stats())
        for expected in ("steps", "appended_tokens", "recalled_pages", "host_waits",
                         "graph_launches", "resident_bytes"):
            self.assertIn(expected, names)
        self.assertEqual(len(names), len(set(names)))

    def test_handles_may_be_freed_in_any_order(self):
        # A script whose device and sequence are both globals: Python frees them at exit in
        # an order of its own, the device possibly first (the library's handles share it).
        script = ("import numpy as np, kvtier\n"
                  "dev = kvtier.Device('cpu')\n"
                  "g = kvtier.LocalGeometry(num_layers=1, num_q_heads=4, num_kv_heads=2, "
                  "head_dim=16, page_size=8, dtype='float32')\n"
                  "seq = kvtier.Sequence(dev, g, kvtier.SequenceOptions(max_tokens=64, "
                  "budget_tokens=32))\n"
                  "seq.append(0, np.ones((20, 2, 16), np.float32), np.ones((20, 2, 16), np.float32))\n"
                  "def f():\n    pass\n"
                  "del dev\n")
        import subprocess
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)

    def test_calls_from_threads_run_concurrently(self):
        # ctypes releases the GIL around every call: two sequences driven from two threads.
        g = self.geometry()
        errors = []

        def drive(seed):
            try:
                rng = np.random.default_rng(seed)
                s = kvtier.Sequence(self.dev, g, kvtier.SequenceOptions(mode="full",
                                                                        max_tokens=256))
                k = rng.standard_normal((100, 2, 16)).astype(np.float32)
                s.append(0, k, k)
                q = rng.standard_normal((4, 16)).astype(np.float32)
                out = np.zeros_like(q)
                for _ in range(20):
                    s.decode(0, q, out)
                want = reference_attention(q, [k[:, 0], k[:, 1]], [k[:, 0], k[:, 1]], 2)
                np.testing.assert_allclose(out, want, atol=1e-5)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])


@unittest.skipIf(kvtier is None or torch is None,
                 "needs kvtier and torch: %s" % (IMPORT_ERROR or "torch not importable"))
class TorchTest(unittest.TestCase):
    def test_torch_tensors_in_and_views_out(self):
        dev = kvtier.Device("cpu")
        g = kvtier.LocalGeometry(dtype="float16", **SMALL)
        seq = kvtier.Sequence(dev, g, kvtier.SequenceOptions(mode="full", max_tokens=256))
        torch.manual_seed(0)
        k = torch.randn(40, 2, 16, dtype=torch.float16)
        v = torch.randn(40, 2, 16, dtype=torch.float16)
        seq.append(0, k, v)
        q = torch.randn(4, 16, dtype=torch.float16)
        out = torch.zeros(4, 16, dtype=torch.float16)
        seq.decode(0, q, out)
        want = reference_attention(q.float().numpy(), [k[:, 0].float().numpy(),
                                                       k[:, 1].float().numpy()],
                                   [v[:, 0].float().numpy(), v[:, 1].float().numpy()], 2)
        np.testing.assert_allclose(out.float().numpy(), want, atol=3e-3)
        view = seq.batch.begin_step(0, [seq], q)[0]
        kc = torch.from_dlpack(view.k_cache)
        self.assertEqual(kc.dtype, torch.float16)
        self.assertEqual(tuple(kc.shape), (view.num_slots, 8, 2, 16))
        table = torch.from_dlpack(view.slot_table)
        self.assertEqual(table.dtype, torch.int32)
        # Full mode: slot s holds page s.
        self.assertTrue(torch.equal(kc[0, :8], k[:8]))
        seq.batch.attend(0, [seq], q, out)
        seq.batch.end_step(0, [seq], q)
        with self.assertRaises(kvtier.Error) as e:
            seq.decode(0, q.t(), out)  # a transposed view: not contiguous
        self.assertIn("not contiguous", e.exception.message)


@unittest.skipUnless(_support.cuda_usable(kvtier, torch), "needs a GPU, torch with CUDA and a CUDA build of libkvtier")
class CudaTest(unittest.TestCase):
    """The same data path on CUDA tensors, with torch's stream adopted as the sequences'
    compute stream (the GPU bundle's step 10 runs this)."""

    def setUp(self):
        self.dev = kvtier.Device("cuda")
        self.g = kvtier.LocalGeometry(dtype="float16", **SMALL)
        self.stream = torch.cuda.Stream()
        torch.manual_seed(1)

    def test_full_mode_on_cuda_tensors_with_torch_s_stream(self):
        with torch.cuda.stream(self.stream):
            o = kvtier.SequenceOptions(mode="full", max_tokens=512, stream=self.stream)
            seq = kvtier.Sequence(self.dev, self.g, o)
            k = torch.randn(77, 2, 16, dtype=torch.float16, device="cuda")
            v = torch.randn(77, 2, 16, dtype=torch.float16, device="cuda")
            seq.append(0, k, v)
            q = torch.randn(4, 16, dtype=torch.float16, device="cuda")
            out = torch.empty_like(q)
            seq.decode(0, q, out)  # ordered on self.stream: no host wait
            got = out.float().cpu()  # the copy waits for the stream
        want = reference_attention(q.float().cpu().numpy(),
                                   [k[:, h].float().cpu().numpy() for h in range(2)],
                                   [v[:, h].float().cpu().numpy() for h in range(2)], 2)
        np.testing.assert_allclose(got.numpy(), want, atol=3e-3)
        self.assertEqual(seq.batch.native_stream, self.stream.cuda_stream)

    def test_views_on_cuda_hold_the_tokens_their_tables_name(self):
        with torch.cuda.stream(self.stream):
            o = kvtier.SequenceOptions(mode="speculative", budget_tokens=32, max_tokens=512,
                                       stream=self.stream)
            seq = kvtier.Sequence(self.dev, self.g, o)
            k = torch.randn(150, 2, 16, dtype=torch.float16, device="cuda")
            v = torch.randn(150, 2, 16, dtype=torch.float16, device="cuda")
            for layer in range(self.g.num_layers):
                seq.append(layer, k, v)
            for step in range(4):
                q = torch.randn(4, 16, dtype=torch.float16, device="cuda")
                out = torch.empty_like(q)
                view = seq.batch.begin_step(0, [seq], q)[0]
                seq.batch.attend(0, [seq], q, out)
                kc = torch.from_dlpack(view.k_cache)
                table = torch.from_dlpack(view.slot_table)
                self.assertEqual(kc.device.type, "cuda")
                kc_host, table_host = kc.cpu(), table.cpu()  # copies after the step's work
                got = out.float().cpu().numpy()
                held_k, held_v = [], []
                for h in range(2):
                    tokens = []
                    for s in range(view.num_slots):
                        page = int(table_host[h, s])
                        if page < 0:
                            continue
                        n = min(8, view.num_tokens - page * 8)
                        self.assertTrue(torch.equal(kc_host[s, :n, h],
                                                    k[page * 8:page * 8 + n, h].cpu()))
                        tokens.extend(range(page * 8, page * 8 + n))
                    held_k.append(k[tokens, h].float().cpu().numpy())
                    held_v.append(v[tokens, h].float().cpu().numpy())
                np.testing.assert_allclose(got, reference_attention(q.float().cpu().numpy(),
                                                                    held_k, held_v, 2),
                                           atol=3e-3)
                seq.batch.end_step(0, [seq], q)
            self.stream.synchronize()
        seq.wait()
        self.assertGreater(seq.stats()["checked_heads"], 0)
        with self.assertRaises(kvtier.Error) as e:
            seq.decode(0, torch.zeros(4, 16, dtype=torch.float16), torch.zeros(4, 16,
                                                                               dtype=torch.float16))
        self.assertIn("on cuda; got float16 [4, 16] on cpu", e.exception.message)


if __name__ == "__main__":
    unittest.main()
