"""The Python client against a real kvtierd (started here on temporary Unix sockets).

Needs, from the environment (ctest sets both; see client/python/CMakeLists.txt):
  KVTIERD            the kvtierd executable
  KVTIER_PYTHONPATH  the generated package root (<build>/client/python)
Without them every test is skipped. Run with the interpreter that has grpcio
(Debian: /usr/bin/python3).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import unittest
from typing import List, Optional, Tuple

KVTIERD = os.environ.get("KVTIERD", "")
# The one-option table every entry point answers alike (tests/include/option_table.toml).
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
OPTION_TABLE = os.environ.get("KVTIER_OPTION_TABLE") or os.path.join(
    _ROOT, "tests", "include", "option_table.toml"
)
if os.environ.get("KVTIER_PYTHONPATH"):
    sys.path.insert(0, os.environ["KVTIER_PYTHONPATH"])

try:
    import grpc

    import kvtier
    from kvtier import Chunk, Client, Geometry, KvtierError, pack_fp16, unpack_fp16
except ImportError as e:  # no grpcio, or the package was not generated
    kvtier = None
    IMPORT_ERROR = str(e)

TENANT = "py"
TOKEN = "t0k"
GEOMETRY = dict(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=32)
BUDGET_TOKENS = 512  # a multiple of 4 pages (SequenceOptions::SetBudgetTokens)
NUM_TOKENS = 200  # 6 full pages and a partial one
START_TIMEOUT_S = 60.0


def skip_reason() -> Optional[str]:
    if kvtier is None:
        return f"kvtier package not importable: {IMPORT_ERROR}"
    if not KVTIERD:
        return "KVTIERD is not set (the kvtierd executable)"
    if not os.access(KVTIERD, os.X_OK):
        return f"KVTIERD={KVTIERD} is not executable"
    return None


class Daemon:
    """kvtierd on temporary sockets with one tenant; stop() sends SIGTERM."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvtier-py-")
        self.socket = os.path.join(self.dir, "kvtierd.sock")
        self.attach_socket = os.path.join(self.dir, "attach.sock")
        config = os.path.join(self.dir, "kvtierd.toml")
        with open(config, "w") as f:
            f.write(
                "[server]\n"
                f'unix_socket = "{self.socket}"\n'
                f'attach_socket = "{self.attach_socket}"\n'
                "cpu_threads = 2\n"
                "[log]\n"
                'level = "warn"\n'
                "[[tenant]]\n"
                f'name = "{TENANT}"\n'
                f'token = "{TOKEN}"\n'
                f"host_memory_bytes = {64 << 20}\n"
                'hugepages = "off"\n'
                "lock = false\n"
            )
        self.log_path = os.path.join(self.dir, "kvtierd.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [KVTIERD, "--config", config], stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def wait_serving(self, client: "Client") -> None:
        """Polls health until SERVING; fails when the daemon exits or the deadline passes."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"kvtierd exited with {self.proc.returncode} at start-up:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"kvtierd not serving after {START_TIMEOUT_S} s:\n{self.log()}"
                )
            try:  # blocks until the channel connects (or 0.5 s pass)
                if client.health(wait_for_ready=True, timeout=0.5) == "SERVING":
                    return
            except KvtierError:
                continue
            try:  # connected but not serving yet: the poll interval, watching for an exit
                self.proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> int:
        """SIGTERM, then the exit code (killed after a minute: a hang is a failure)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def random_fp16(rng: random.Random, count: int) -> Tuple[bytes, List[float]]:
    """`count` pseudo-random fp16 values in [-1, 1): their bytes and their exact values."""
    packed = pack_fp16(rng.uniform(-1.0, 1.0) for _ in range(count))
    return packed, unpack_fp16(packed)


def hnd_page(k: bytes, v: bytes, page: int, g: Geometry) -> bytes:
    """The host page `page` of NHD tokens [n][Hkv][d]: HND [Hkv][K, V][p][d]
    (include/kvtier/layout.h HostPageLayout)."""
    row = g.head_dim * g.element_bytes
    out = bytearray()
    for h in range(g.num_kv_heads):
        for src in (k, v):
            for t in range(page * g.page_size, (page + 1) * g.page_size):
                start = (t * g.num_kv_heads + h) * row
                out += src[start : start + row]
    return bytes(out)


def attention_reference(q: List[float], k: List[float], v: List[float], g: Geometry) -> List[float]:
    """Exact decode attention over every token: q [Hq][d], k and v NHD; scale 1/sqrt(d);
    query head h reads KV head h // (Hq / Hkv). Returns [Hq][d]."""
    hq, hkv, d = g.num_q_heads, g.num_kv_heads, g.head_dim
    n = len(k) // (hkv * d)
    out: List[float] = []
    for h in range(hq):
        kvh = h // (hq // hkv)
        qh = q[h * d : (h + 1) * d]
        scores = []
        for t in range(n):
            base = (t * hkv + kvh) * d
            scores.append(sum(a * b for a, b in zip(qh, k[base : base + d])) / math.sqrt(d))
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        acc = [0.0] * d
        for t, w in enumerate(weights):
            base = (t * hkv + kvh) * d
            for i in range(d):
                acc[i] += w * v[base + i]
        total = sum(weights)
        out.extend(a / total for a in acc)
    return out


class ClientTest(unittest.TestCase):
    """One daemon for the class; every test opens what it needs."""

    daemon: "Daemon"
    client: "Client"

    @classmethod
    def setUpClass(cls) -> None:
        reason = skip_reason()
        if reason:
            raise unittest.SkipTest(reason)
        cls.daemon = Daemon()
        cls.client = Client("unix://" + cls.daemon.socket, tenant=TENANT, token=TOKEN)
        try:
            cls.daemon.wait_serving(cls.client)
        except BaseException:
            cls.daemon.stop()
            cls.daemon.cleanup()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        code = cls.daemon.stop()
        log = cls.daemon.log() if code != 0 else ""
        cls.daemon.cleanup()
        if code != 0:
            raise AssertionError(f"kvtierd exited with {code} after SIGTERM:\n{log}")

    def open(self, **kwargs) -> "kvtier.Session":
        session = self.client.open_session(
            GEOMETRY, budget_tokens=BUDGET_TOKENS, transport="grpc", max_tokens=1024, **kwargs
        )
        self.addCleanup(self._close_quietly, session)
        return session

    @staticmethod
    def _close_quietly(session: "kvtier.Session") -> None:
        try:
            session.close()
        except KvtierError:
            pass  # the test closed it already

    def test_hello_reports_protocol_tenant_and_limits(self) -> None:
        hello = self.client.hello()
        self.assertEqual(hello.protocol_version, kvtier.PROTOCOL_VERSION)
        self.assertLessEqual(hello.min_protocol_version, kvtier.PROTOCOL_VERSION)
        self.assertEqual(hello.tenant, TENANT)
        self.assertGreater(hello.limits.max_message_bytes, 0)
        self.assertGreater(hello.limits.max_tokens_per_offload, 0)
        self.assertEqual(hello.attach_socket, self.daemon.attach_socket)

    def test_health_is_serving(self) -> None:
        self.assertEqual(self.client.health(), "SERVING")

    def test_offload_step_fetch_and_stats(self) -> None:
        session = self.open(label="roundtrip")
        g = session.geometry
        self.assertEqual(g, Geometry(**GEOMETRY))
        rng = random.Random(20240611)
        sent = []
        for layer in range(g.num_layers):
            k, k_values = random_fp16(rng, NUM_TOKENS * g.num_kv_heads * g.head_dim)
            v, v_values = random_fp16(rng, NUM_TOKENS * g.num_kv_heads * g.head_dim)
            result = session.offload(layer, k, v, NUM_TOKENS)
            self.assertEqual(result.layer_tokens[layer], NUM_TOKENS)
            sent.append((k, v, k_values, v_values))

        self.assertIn(session.id, [s.session_id for s in self.client.list_sessions()])

        for layer in range(g.num_layers):
            q, q_values = random_fp16(rng, g.num_q_heads * g.head_dim)
            step = session.step(layer, q)
            self.assertEqual(step.layer, layer)
            self.assertEqual(step.num_tokens, NUM_TOKENS)
            self.assertGreater(step.num_slots, 0)
            self.assertEqual(len(step.slot_table), g.num_kv_heads * step.num_slots)
            last_page = (NUM_TOKENS - 1) // g.page_size
            self.assertTrue(all(-1 <= p <= last_page for p in step.slot_table), step.slot_table)
            self.assertEqual(len(step.output), g.num_q_heads * g.head_dim * 2)
            self.assertEqual(len(step.lse), g.num_q_heads)
            # The budget (16 pages) holds all 7 pages: the output is exact attention.
            _, _, k_values, v_values = sent[layer]
            expected = attention_reference(q_values, k_values, v_values, g)
            got = unpack_fp16(step.output)
            for i, (a, b) in enumerate(zip(got, expected)):
                self.assertLess(abs(a - b), 2e-2 + 1e-2 * abs(b), f"layer {layer} element {i}")

        for layer in range(g.num_layers):
            k, v, _, _ = sent[layer]
            pages = session.fetch(layer, [0])
            self.assertEqual(len(pages), 1)
            self.assertEqual((pages[0].layer, pages[0].page), (layer, 0))
            self.assertGreaterEqual(pages[0].generation, 1)
            self.assertEqual(len(pages[0].data), g.page_bytes)
            self.assertEqual(pages[0].data, hnd_page(k, v, 0, g))
            everything = session.fetch(layer)
            self.assertEqual([p.page for p in everything], list(range(NUM_TOKENS // g.page_size)))
            self.assertEqual(everything[5].data, hnd_page(k, v, 5, g))

        stats = session.stats()
        self.assertEqual(stats.session_id, session.id)
        self.assertEqual(stats.committed_pages, g.num_layers * (NUM_TOKENS // g.page_size))
        self.assertEqual(stats.appended_tokens, g.num_layers * NUM_TOKENS)  # summed over layers
        self.assertEqual(stats.offloaded_pages, g.num_layers * (NUM_TOKENS // g.page_size))
        self.assertGreaterEqual(stats.steps, 1)
        closed = session.close()
        self.assertEqual(closed.committed_pages, g.num_layers * (NUM_TOKENS // g.page_size))
        self.assertNotIn(session.id, [s.session_id for s in self.client.list_sessions()])

    def test_offload_accepts_an_iterator_of_chunks(self) -> None:
        session = self.open()
        g = session.geometry
        rng = random.Random(7)
        sizes = [64, 64, 72]

        def chunks():
            for i, n in enumerate(sizes):
                k, _ = random_fp16(rng, n * g.num_kv_heads * g.head_dim)
                v, _ = random_fp16(rng, n * g.num_kv_heads * g.head_dim)
                yield Chunk(k=k, v=v, num_tokens=n, commit=i == len(sizes) - 1)

        result = session.offload(1, chunks())
        self.assertEqual(result.committed_tokens, sum(sizes))
        self.assertEqual(list(result.layer_tokens), [0, sum(sizes)])

    def test_open_with_the_same_request_id_is_the_same_session(self) -> None:
        first = self.open(request_id="python-retry-1")
        again = self.open(request_id="python-retry-1")
        self.assertEqual(first.id, again.id)
        other = self.open()
        self.assertNotEqual(other.id, first.id)

    def test_correction_trigger_is_carried_and_checked(self) -> None:
        self.assertEqual(self.open().info.retrieval.correction_trigger, "cosine")
        session = self.open(correction_trigger="mass", correction_max_loss=0.25)
        self.assertEqual(session.info.retrieval.correction_trigger, "mass")
        self.assertAlmostEqual(session.info.retrieval.correction_max_loss, 0.25)
        with self.assertRaises(ValueError):
            self.open(correction_trigger="entropy")
        with self.assertRaises(KvtierError) as ctx:
            self.open(correction_trigger="mass", correction_max_loss=2.0)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("correction_max_loss", ctx.exception.message)

    def test_summary_is_carried_and_the_daemons_sequence_scores_with_it(self) -> None:
        # Key codes (the default) keep a code per key and dimension beside the summaries:
        # selection_bytes, every page the session can hold, shows which the daemon's
        # sequence keeps.
        default = self.open()
        self.assertEqual(default.info.retrieval.summary, "key-codes")
        selection = {}
        for summary in ("key-codes", "center-mad", "minmax"):
            session = self.open(summary=summary)
            self.assertEqual(session.info.retrieval.summary, summary)
            self.assertIn(session.id, [s.session_id for s in self.client.list_sessions()])
            selection[summary] = session.stats().counters["selection_bytes"]
        g = default.geometry
        pages = 1024 // g.page_size  # max_tokens of self.open
        summaries = g.num_layers * pages * g.num_kv_heads * 2 * g.head_dim * 2  # fp16 hi, lo
        codes = g.num_layers * pages * g.num_kv_heads * g.page_size * g.head_dim // 2
        self.assertEqual(selection["center-mad"], summaries)
        self.assertEqual(selection["minmax"], summaries)
        self.assertEqual(selection["key-codes"], summaries + codes)
        with self.assertRaises(ValueError):
            self.open(summary="pca")

    def test_every_case_of_the_option_table_is_answered_as_the_table_says(self) -> None:
        # The client checks nothing itself: the daemon's resolver answers, with the message
        # the C++ entry points give (tests/client/option_table_test.cc).
        with open(OPTION_TABLE, "rb") as f:
            table = tomllib.load(f)
        base = table["base"]
        cases = [dict(base, **case) for case in table["case"]]
        self.assertTrue(any("error" not in c for c in cases))
        self.assertTrue(any("error" in c for c in cases))
        for c in cases:
            if not c.get("wire", True):
                continue  # a negative value: the protocol's fields are unsigned
            with self.subTest(case=c["name"]):
                geometry = dict(GEOMETRY, page_size=c["page_size"])
                kwargs = dict(
                    mode=c["mode"],
                    budget_tokens=c["budget_tokens"],
                    max_tokens=c["max_tokens"],
                    transport="grpc",
                    correction_threshold=c["correction_threshold"],
                    correction_trigger=c["correction_trigger"],
                    correction_max_loss=c["correction_max_loss"],
                    summary=c["summary"],
                    budget_policy=c["budget_policy"],
                    residency_policy=c["residency_policy"],
                    host_drop=c["host_drop"],
                    policy_params=c.get("policy_params", {}),
                    sink_pages=c.get("sink_pages"),
                    recent_pages=c.get("recent_pages"),
                )
                if "error" not in c:
                    session = self.client.open_session(geometry, **kwargs)
                    self.assertEqual(session.info.retrieval.summary, c["summary"])
                    if "sink_pages" in c:
                        self.assertEqual(session.info.retrieval.sink_pages, c["sink_pages"])
                        self.assertEqual(session.info.retrieval.recent_pages, c["recent_pages"])
                    self._close_quietly(session)
                    continue
                with self.assertRaises(KvtierError) as ctx:
                    self.client.open_session(geometry, **kwargs)
                self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertEqual(ctx.exception.message, c["error"])

    def test_host_tokens_and_host_drop_are_carried_and_checked(self) -> None:
        # Below max_tokens without demotion, and demotion without a cold tier: both refused,
        # naming what the request carried.
        with self.assertRaises(KvtierError) as ctx:
            self.open(host_tokens=64)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("retrieval.host_tokens = 64", ctx.exception.message)
        with self.assertRaises(KvtierError) as ctx:
            self.open(host_drop="demote", residency_policy="h2o")
        self.assertEqual(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("no cold tier", ctx.exception.message)

    def test_the_engine_s_signals_reach_a_grpc_session_s_policies(self) -> None:
        # Conf-KV's budget in the daemon turns tight after four confident steps: with the
        # engine's logits reported (ReportSignals) the budget changes; without them, never.
        # A retry applies nothing twice; bad sizes are refused naming the field.
        g = None
        changes = {}
        for report in (False, True):
            session = self.open(budget_policy="confidence")
            g = session.geometry
            rng = random.Random(21)
            k, _ = random_fp16(rng, NUM_TOKENS * g.num_kv_heads * g.head_dim)
            v, _ = random_fp16(rng, NUM_TOKENS * g.num_kv_heads * g.head_dim)
            for layer in range(g.num_layers):
                session.offload(layer, k, v, NUM_TOKENS)
            confident = [0.0] * 100
            confident[7] = 40.0  # all the mass on one token
            for t in range(8):
                for layer in range(g.num_layers):
                    one_k, _ = random_fp16(rng, g.num_kv_heads * g.head_dim)
                    session.offload(layer, one_k, one_k, 1)
                    q, _ = random_fp16(rng, g.num_q_heads * g.head_dim)
                    session.step(layer, q, want_output=False)
                if report:
                    self.assertFalse(session.report_signals(NUM_TOKENS + t, 1, logits=confident))
            changes[report] = session.stats().counters["budget_changes"]
            if report:
                self.assertTrue(session.report_signals(NUM_TOKENS + 7, 1, logits=confident))
                q, _ = random_fp16(rng, 3 * g.num_q_heads * g.head_dim)
                self.assertFalse(session.observe_queries(0, q, NUM_TOKENS - 3))
                self.assertTrue(session.observe_queries(0, q, NUM_TOKENS - 3))
                for kwargs, field in (
                        (dict(first_position=0, num_tokens=2, hidden_delta=[1.0] * 3,
                              num_layers=2), "hidden_delta"),
                        (dict(first_position=0, num_tokens=0, logits=confident), "num_tokens")):
                    with self.assertRaises(KvtierError) as ctx:
                        session.report_signals(**kwargs)
                    self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertIn(field, ctx.exception.message)
                with self.assertRaises(KvtierError) as ctx:
                    session.observe_queries(0, q[:-2], NUM_TOKENS - 3)
                self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("observe_q", ctx.exception.message)
        self.assertEqual(changes[False], 0)
        self.assertGreater(changes[True], 0)

    def test_steps_are_numbered_and_a_retry_replays(self) -> None:
        session = self.open()
        g = session.geometry
        rng = random.Random(11)
        k, _ = random_fp16(rng, NUM_TOKENS * g.num_kv_heads * g.head_dim)
        v, _ = random_fp16(rng, NUM_TOKENS * g.num_kv_heads * g.head_dim)
        session.offload(0, k, v, NUM_TOKENS)
        q, _ = random_fp16(rng, g.num_q_heads * g.head_dim)
        first = session.step(0, q)
        self.assertEqual((first.step, first.replayed), (1, False))
        again = session.step(0, q, step=1)  # a retry of a step whose reply was lost
        self.assertEqual((again.step, again.replayed), (1, True))
        self.assertEqual(again.output, first.output)
        self.assertEqual(again.slot_table, first.slot_table)
        with self.assertRaises(KvtierError) as ctx:
            session.step(0, q, step=3)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(ctx.exception.trailers.get("x-kvtier-steps-run"), "1")
        q2, _ = random_fp16(rng, g.num_q_heads * g.head_dim)
        self.assertEqual(session.step(0, q2).step, 2)
        self.assertEqual(session.stats().steps, 2)

    def test_offload_never_appends_a_token_twice(self) -> None:
        session = self.open()
        g = session.geometry
        rng = random.Random(12)
        k, _ = random_fp16(rng, 64 * g.num_kv_heads * g.head_dim)
        v, _ = random_fp16(rng, 64 * g.num_kv_heads * g.head_dim)
        session.offload(0, k, v, 64)
        # Another holder appends behind this session's back: its next offload (which starts
        # at token 64) is refused, and it learns where the layer ends.
        other = self.client.reattach(session.id)
        self.assertEqual(other.num_tokens(0), 64)
        other.offload(0, k[: 8 * g.token_bytes], v[: 8 * g.token_bytes], 8)
        with self.assertRaises(KvtierError) as ctx:
            session.offload(0, k[: 8 * g.token_bytes], v[: 8 * g.token_bytes], 8)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(session.num_tokens(0), 72)
        session.offload(0, k[: 8 * g.token_bytes], v[: 8 * g.token_bytes], 8)
        self.assertEqual(session.num_tokens(0), 80)

    def test_step_with_wrong_q_size_is_invalid_argument(self) -> None:
        session = self.open()
        with self.assertRaises(KvtierError) as ctx:
            session.step(0, b"\0" * 10)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(ctx.exception.message)

    def test_wrong_token_is_permission_denied(self) -> None:
        with Client("unix://" + self.daemon.socket, tenant=TENANT, token="wrong") as bad:
            with self.assertRaises(KvtierError) as ctx:
                bad.list_sessions()
            self.assertEqual(ctx.exception.code, grpc.StatusCode.PERMISSION_DENIED)

    def test_unknown_tenant_is_permission_denied(self) -> None:
        with Client("unix://" + self.daemon.socket, tenant="nobody") as bad:
            with self.assertRaises(KvtierError) as ctx:
                bad.hello()
            self.assertEqual(ctx.exception.code, grpc.StatusCode.PERMISSION_DENIED)

    def test_closed_session_is_not_found(self) -> None:
        session = self.open()
        session.close()
        with self.assertRaises(KvtierError) as ctx:
            session.step(0, b"\0" * (8 * 64 * 2))
        self.assertEqual(ctx.exception.code, grpc.StatusCode.NOT_FOUND)


class ShutdownTest(unittest.TestCase):
    def test_sigterm_exits_zero_and_removes_the_sockets(self) -> None:
        reason = skip_reason()
        if reason:
            self.skipTest(reason)
        daemon = Daemon()
        self.addCleanup(daemon.cleanup)
        with Client(daemon.socket, tenant=TENANT, token=TOKEN) as client:
            daemon.wait_serving(client)
        self.assertEqual(daemon.stop(), 0, daemon.log())
        self.assertFalse(os.path.exists(daemon.socket))
        self.assertFalse(os.path.exists(daemon.attach_socket))


if __name__ == "__main__":
    unittest.main(verbosity=2)
