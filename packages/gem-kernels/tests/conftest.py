"""Test setup: Triton kernels run through the Triton interpreter on CPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time, unless the
caller set it: ``TRITON_INTERPRET=0`` on a CUDA host runs the compiled kernels' tests (``test_gpu_*``) and skips the
interpreter's (``triton_on_cpu``).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

# NOTE: the suite runs with --import-mode=importlib, which puts nothing on sys.path: the shared helpers module
# (uniquely named, since the whole workspace's tests run in one process) is found through this folder, and the
# package through src/ when it is not installed (a bare venv rather than the hatch env).
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
try:
    import gem_kernels  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_HERE.parent / "src"))

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: F401,E402
    import triton.runtime.interpreter as _interp  # noqa: E402

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the host
    HAS_TRITON = False


def _patch_interpreter_scalar_index() -> None:
    # NOTE: the interpreter stores scalars as 1-element arrays and converts them with int(array), which
    # numpy >= 2.4 rejects for arrays of rank 1; data-dependent loop bounds (every jagged kernel) then fail.
    # Convert through .item() instead. Only the interpreter is touched, and only in the tests.
    orig = _interp._patch_lang_tensor
    if getattr(orig, "_gem_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._gem_patched = True
    _interp._patch_lang_tensor = patched


if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()

# NOTE: these tests launch the Triton kernels on CPU tensors, which only the interpreter runs: with
# TRITON_INTERPRET=0 (a CUDA host running the compiled kernels' tests, test_gpu_*) they skip
triton_on_cpu = pytest.mark.skipif(
    not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels on CPU tensors run through the interpreter only: set TRITON_INTERPRET=1"
    if HAS_TRITON else "triton is not importable on this host")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
