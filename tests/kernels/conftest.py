"""Kernel tests run on CUDA when there is a GPU, else in the Triton interpreter.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before *triton itself* is imported: triton's
own ``tl.zeros``, ``tl.sum``... are ``@triton.jit`` functions, compiled or interpreted at import. So this
file, which pytest imports before the test modules of this folder, imports triton and the kernels with the
variable set, then restores the environment so the rest of the session sees what it expects (tests here
get the variable back through ``monkeypatch``: ``helm.ops``' ``impl="triton"`` reads it at call time).

If an earlier test module already imported triton for the GPU (``transformers`` imports it, for one),
triton cannot be re-imported in this process; each kernel test then runs in a child pytest process that
enables the interpreter from the start, and passes or fails with it.
"""

import importlib
import os
import subprocess
import sys

import pytest

from tests.kernels.device import ON_GPU

KERNELS = "kernels.lorentz_attention"
_CHILD_FLAG = "HELM_KERNEL_TESTS_INTERPRETED_CHILD"


def _triton_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton"].language.zeros, InterpretedFunction)


def _import_for_this_machine():
    """``(module or None, runs_in_process)``."""
    try:
        if ON_GPU:
            return importlib.import_module(KERNELS), True
        if "triton" in sys.modules and not _triton_interpreted():
            return None, False
        common = sys.modules.get(KERNELS + ".common")
        if common is not None and not common.INTERPRET:
            for name in [m for m in sys.modules if m == KERNELS or m.startswith(KERNELS + ".")]:
                del sys.modules[name]
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            return importlib.import_module(KERNELS), True
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
    except ImportError:
        return None, True


_MODULE, IN_PROCESS = _import_for_this_machine()
if not IN_PROCESS and os.environ.get(_CHILD_FLAG):
    raise RuntimeError("triton was imported before tests/kernels/conftest.py could enable its interpreter")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Out-of-process fallback (see the module docstring): run this one test in a fresh interpreter."""
    if IN_PROCESS:
        return None
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_FLAG: "1"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                          cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"in a child process with TRITON_INTERPRET=1:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}",
                    pytrace=False)
    return True


@pytest.fixture(scope="session")
def lk():
    """The :mod:`kernels.lorentz_attention` package, runnable on this machine."""
    if _MODULE is None and IN_PROCESS:
        pytest.skip("triton is not installed")
    return _MODULE


@pytest.fixture(autouse=True)
def _kernel_env(monkeypatch, lk):
    """Interpreter flag for helm's dispatcher, and NaN-filled kernel buffers to expose unwritten reads."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if lk is not None:
        monkeypatch.setattr(lk.common, "DEBUG_NAN_FILL", True)
