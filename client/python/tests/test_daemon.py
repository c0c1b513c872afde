"""kvtier.daemon: kvtierd's SHM sessions from Python over the C API, against a real kvtierd.

Needs KVTIERD (the daemon), KVTIER_PYTHONPATH (the package root) and KVTIER_LIBRARY
(libkvtier.so), as ctest sets them, and numpy. Without them every test is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _support  # noqa: E402 - the package on the path

kvtier, IMPORT_ERROR = _support.load_kvtier("numpy", "kvtier.daemon", "test_client")
if kvtier is not None:
    import numpy as np

    import kvtier.daemon as kd
    from test_client import TENANT, TOKEN, Daemon  # kvtierd on temporary sockets

KVTIERD = os.environ.get("KVTIERD", "")
GEOMETRY = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=32,
                dtype="float16")


def reference(q, k, v):
    out = np.zeros(q.shape)
    for h in range(q.shape[0]):
        kk, vv = k[:, h // 2].astype(np.float64), v[:, h // 2].astype(np.float64)
        s = kk @ q[h].astype(np.float64) / np.sqrt(q.shape[1])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv
    return out


@unittest.skipIf(kvtier is None or not KVTIERD,
                 "needs the package, numpy and KVTIERD: %s" % (IMPORT_ERROR or "KVTIERD unset"))
class DaemonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.target = "unix://" + cls.daemon.socket
        deadline = time.monotonic() + 60
        while True:  # serving once a session opens
            try:
                client = kd.connect(cls.target, tenant=TENANT, token=TOKEN, timeout_ms=2000)
                s = client.open_session(kvtier.LocalGeometry(**GEOMETRY), mode="full",
                                        budget_tokens=128, max_tokens=256)
                s.close()
                break
            except kvtier.Error as e:
                if e.code != "UNAVAILABLE" or cls.daemon.proc.poll() is not None or \
                        time.monotonic() > deadline:
                    raise AssertionError("kvtierd did not serve:\n" + cls.daemon.log())
                time.sleep(0.1)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        cls.daemon.cleanup()

    def setUp(self):
        self.client = kd.connect(self.target, tenant=TENANT, token=TOKEN)
        self.g = kvtier.LocalGeometry(**GEOMETRY)
        self.rng = np.random.default_rng(3)

    def kv(self, n):
        return (self.rng.standard_normal((n, 2, 32)).astype(np.float16),
                self.rng.standard_normal((n, 2, 32)).astype(np.float16))

    def test_a_session_decodes_like_full_attention_and_reports_its_slots(self):
        s = self.client.open_session(self.g, mode="full", budget_tokens=128, max_tokens=512)
        k, v = self.kv(100)
        for layer in range(2):
            s.append(layer, k, v)
        q = self.rng.standard_normal((4, 32)).astype(np.float16)
        out = np.zeros_like(q)
        table = s.decode(0, q, out, slot_table=True)
        np.testing.assert_allclose(out.astype(np.float64), reference(q, k, v), atol=3e-3)
        self.assertEqual(len(table), 2)
        self.assertEqual(sorted(p for p in table[0] if p >= 0), [0, 1, 2, 3])
        with self.assertRaises(kvtier.Error) as e:
            s.append(0, k.astype(np.float32), v)
        self.assertIn("k: expected a contiguous float16", e.exception.message)
        s.close()

    def test_policies_are_carried_and_judged(self):
        # An SHM session's policies run in this process's sequence, and the daemon judges them
        # as it does a GRPC session's: the registry's message for a name it does not know.
        with self.assertRaises(kvtier.Error) as e:
            self.client.open_session(self.g, mode="drop", budget_tokens=128, max_tokens=512,
                                     residency_policy="h3o")
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertEqual(e.exception.message, "policy.residency = 'h3o': unknown; one of none, "
                         "attention, h2o, epiphany, kv_compress")
        with self.assertRaises(TypeError):
            self.client.open_session(self.g, residency="h2o")
        s = self.client.open_session(self.g, mode="drop", budget_tokens=128, max_tokens=512,
                                     residency_policy="attention",
                                     policy_params={"attention.beta": "0.5"})
        k, v = self.kv(300)
        for layer in range(2):
            s.append(layer, k, v)
        q = self.rng.standard_normal((4, 32)).astype(np.float16)
        out = np.zeros_like(q)
        for _ in range(3):
            for layer in range(2):
                s.append(layer, *self.kv(1))
                table = s.decode(layer, q, out, slot_table=True)
        # Conf-KV's ranker manages the working set: at most the budget's 4 pages per KV head.
        self.assertTrue(all(sum(p >= 0 for p in row) <= 4 for row in table), table)
        # The engine's signals reach the session's sequence; bad ones get its answer.
        s.observe_queries(0, self.rng.standard_normal((4, 4, 32)).astype(np.float16), 296)
        s.report_signals(303, 1, logits=np.zeros(50, np.float32),
                         hidden_delta=np.ones((1, 2), np.float32))
        with self.assertRaises(kvtier.Error) as e:
            s.report_signals(-1, 1, logits=np.zeros(50, np.float32))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("first_position = -1", e.exception.message)
        s.close()

    def test_a_session_left_by_a_process_that_died_is_reattached(self):
        # A child process opens a session, appends 100 tokens (3 full pages and a partial
        # one), flushes and dies without closing; this process takes the session over.
        child = textwrap.dedent("""
            import os, sys
            import numpy as np
            import kvtier, kvtier.daemon as kd
            c = kd.connect(sys.argv[1], tenant=sys.argv[2], token=sys.argv[3])
            g = kvtier.LocalGeometry(num_layers=2, num_q_heads=4, num_kv_heads=2,
                                     head_dim=32, page_size=32, dtype="float16")
            s = c.open_session(g, mode="speculative", budget_tokens=128, max_tokens=512)
            rng = np.random.default_rng(11)
            k = rng.standard_normal((100, 2, 32)).astype(np.float16)
            for layer in range(2):
                s.append(layer, k, k)
            s.flush()
            print(s.id, flush=True)
            os._exit(0)
        """)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        done = subprocess.run([sys.executable, "-c", child, self.target, TENANT, TOKEN],
                              capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        sid = done.stdout.strip().splitlines()[-1]
        deadline = time.monotonic() + 30
        while True:  # the daemon notices the dead process's attachment
            try:
                s = self.client.reattach(sid, self.g, mode="speculative", budget_tokens=128,
                                         max_tokens=512)
                break
            except kvtier.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        committed = s.num_tokens(0)
        self.assertEqual(committed, 96, "the committed full pages come back")
        k = np.random.default_rng(11).standard_normal((100, 2, 32)).astype(np.float16)
        for layer in range(2):
            s.append(layer, k[committed:], k[committed:])  # re-append the rest
        self.assertEqual(s.num_tokens(1), 100)
        q = self.rng.standard_normal((4, 32)).astype(np.float16)
        out = np.zeros_like(q)
        s.decode(0, q, out)
        self.assertTrue(np.all(np.isfinite(out)))
        s.suspend()
        s.detach()
        again = self.client.reattach(sid, self.g, mode="speculative", budget_tokens=128,
                                     max_tokens=512)
        self.assertEqual(again.num_tokens(0), 96)
        again.close()


if __name__ == "__main__":
    unittest.main()
