"""`pip install client/python` from the tree: the installed package (outside the build tree)
loads libkvtier.so from $KVTIER_LIBRARY and decodes, with no numpy or torch needed (typed
buffers). Needs KVTIER_LIBRARY and pip with setuptools; skipped without them. The package is
built from a copy of the source (pip writes build files next to what it builds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.normpath(os.path.join(HERE, ".."))
LIBRARY = os.environ.get("KVTIER_LIBRARY", "")

SMOKE = textwrap.dedent("""
    import array, math, sys
    import kvtier
    assert kvtier.__file__.startswith(sys.argv[1]), kvtier.__file__
    dev = kvtier.Device("cpu")
    g = kvtier.LocalGeometry(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8,
                             page_size=8, dtype="float32")
    seq = kvtier.Sequence(dev, g, kvtier.SequenceOptions(mode="full", max_tokens=64,
                                                         budget_tokens=32))
    n, d = 10, 8
    k = array.array("f", [((i * 7) % 5) / 5.0 for i in range(n * d)])
    v = array.array("f", [float(i % 3) for i in range(n * d)])
    typed = lambda a, shape: memoryview(a).cast("B").cast("f", shape)
    seq.append(0, typed(k, (n, 1, d)), typed(v, (n, 1, d)))
    q = array.array("f", [0.1 * (i % 5) - 0.2 for i in range(2 * d)])
    out = array.array("f", [0.0] * (2 * d))
    seq.decode(0, typed(q, (2, d)), typed(out, (2, d)))
    for h in range(2):
        s = [sum(q[h * d + i] * k[t * d + i] for i in range(d)) / math.sqrt(d) for t in range(n)]
        m = max(s); w = [math.exp(x - m) for x in s]; z = sum(w)
        for i in range(d):
            ref = sum(w[t] * v[t * d + i] for t in range(n)) / z
            assert abs(out[h * d + i] - ref) < 1e-5, (h, i, out[h * d + i], ref)
    print("installed kvtier decodes")
""")


def pip_usable() -> str:
    try:
        import setuptools  # noqa: F401  (only whether it is there)
    except ImportError:
        return "setuptools is not installed"
    done = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return "" if done.returncode == 0 else "pip is not installed"


@unittest.skipIf(not LIBRARY or pip_usable(), "needs KVTIER_LIBRARY and pip with setuptools: "
                 + (pip_usable() or "KVTIER_LIBRARY unset"))
class InstallTest(unittest.TestCase):
    def test_pip_install_from_the_tree_then_decode(self):
        work = tempfile.mkdtemp(prefix="kvtier-pip-")
        try:
            src = os.path.join(work, "src")
            os.makedirs(src)
            for name in ("pyproject.toml", "README.md"):
                shutil.copy(os.path.join(SOURCE, name), src)
            shutil.copytree(os.path.join(SOURCE, "kvtier"), os.path.join(src, "kvtier"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            site = os.path.join(work, "site")
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                 "--no-index", "--disable-pip-version-check", "--target", site, src],
                capture_output=True, text=True, timeout=300, cwd=work)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
            env.update(PYTHONPATH=site, KVTIER_LIBRARY=LIBRARY)
            run = subprocess.run([sys.executable, "-c", SMOKE, site], env=env,
                                 capture_output=True, text=True, timeout=120, cwd=work)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("installed kvtier decodes", run.stdout)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
