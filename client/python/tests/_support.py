"""What the package's test scripts share: the package on the path (KVTIER_PYTHONPATH, the
package root; else whatever `import kvtier` finds), imported with its library loaded, and
whether a CUDA device is usable. Imported before anything of kvtier."""

import importlib
import os
import sys

if os.environ.get("KVTIER_PYTHONPATH"):
    sys.path.insert(0, os.environ["KVTIER_PYTHONPATH"])


def load_kvtier(*also):
    """(kvtier, "") with libkvtier loaded, or (None, why). `also`: modules the caller needs
    with it (numpy, kvtier.hf, ...), imported first, so that a missing one skips the same
    tests."""
    try:
        for name in also:
            importlib.import_module(name)
        import kvtier
        from kvtier import local

        local._native.lib()
        return kvtier, ""
    except (ImportError, OSError) as e:
        return None, str(e)


def cuda_usable(kvtier, torch):
    """A GPU, torch with CUDA and a CUDA build of libkvtier."""
    if kvtier is None or torch is None or not torch.cuda.is_available():
        return False
    try:
        kvtier.Device("cuda")
        return True
    except kvtier.Error:
        return False
