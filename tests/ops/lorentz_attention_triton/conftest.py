"""Kernel tests run on CUDA when there is a GPU, else in the Triton interpreter.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before *triton itself* is imported: triton's
own ``tl.zeros``, ``tl.sum``... are ``@triton.jit`` functions, compiled or interpreted at import. So this
file, which pytest imports before the test modules of this folder, imports triton and the kernels with the
variable set, then restores the environment so the rest of the session sees what it expects (tests here
get the variable back through ``monkeypatch``: ``helm.ops``' ``impl="triton"`` reads it at call time).

If an earlier test module already imported triton for the GPU (``transformers`` imports it, for one),
triton cannot be re-imported in this process; the kernel tests selected in this session then run together in
one child pytest process that enables the interpreter from the start (one start-up, not one per test), and
each test passes, fails or skips with its outcome there.

On a GPU the tests switch autotuning off (``common.AUTOTUNE``, unless ``HELM_TRITON_AUTOTUNE=1``): each kernel takes
the first of its sm90 candidates that fits instead of compiling and timing them all for every new shape key.
"""

import importlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from tests.ops.lorentz_attention_triton.device import ON_GPU

KERNELS = "helm.ops.lorentz_attention_triton"
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
    raise RuntimeError("triton was imported before tests/ops/lorentz_attention_triton/conftest.py could enable its "
                       "interpreter")


_SELECTED: list = []  # node ids of this folder's tests in the session
_OUTCOMES: dict = {}  # node id -> ("passed" | "failed" | "skipped", message), from the child run


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    _SELECTED[:] = [item.nodeid for item in items if Path(str(item.fspath)).parent == here]


def _run_children(rootpath) -> None:
    """Run every selected kernel test in one child process with the interpreter on; record each outcome."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_FLAG: "1"})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               *_SELECTED], cwd=rootpath, env=env, capture_output=True, text=True, timeout=3600)
        if not report.is_file():
            raise RuntimeError(f"the child kernel test run did not start:\n{proc.stdout[-4000:]}\n"
                               f"{proc.stderr[-2000:]}")
        for case in ElementTree.parse(report).iter("testcase"):
            module = case.get("classname").replace(".", "/") + ".py"
            nodeid = f"{module}::{case.get('name')}"
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            if problem is not None:
                _OUTCOMES[nodeid] = ("failed", f"{problem.get('message', '')}\n{(problem.text or '')[-6000:]}")
            elif skipped is not None:
                _OUTCOMES[nodeid] = ("skipped", skipped.get("message", ""))
            else:
                _OUTCOMES[nodeid] = ("passed", "")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Out-of-process fallback (see the module docstring): report this test's outcome in the child run."""
    if IN_PROCESS:
        return None
    if not _OUTCOMES:
        _run_children(pyfuncitem.config.rootpath)
    outcome, message = _OUTCOMES.get(pyfuncitem.nodeid, ("failed", "the child run did not report this test"))
    if outcome == "failed":
        pytest.fail(f"in a child process with TRITON_INTERPRET=1:\n{message}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(message)
    return True


@pytest.fixture(scope="session")
def lk():
    """The :mod:`helm.ops.lorentz_attention_triton` package, runnable on this machine."""
    if _MODULE is None and IN_PROCESS:
        pytest.skip("triton is not installed")
    return _MODULE


@pytest.fixture
def prepared(lk, monkeypatch):
    """The :class:`~helm.ops.lorentz_attention_triton.common.Prepared` inputs of every ``lorentz_flash_attention`` call
    the test makes, in order (what the kernels read)."""
    calls = []
    if lk is None:  # out of process: the test body runs in the child (module docstring)
        return calls
    real = lk.fwd_bwd.prepare

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(lk.fwd_bwd, "prepare", spy)
    return calls


@pytest.fixture(autouse=True)
def _kernel_env(monkeypatch, lk):
    """Interpreter flag for helm's dispatcher, NaN-filled kernel buffers to expose unwritten reads, and on a GPU
    one configuration per kernel (module docstring)."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if lk is not None:
        monkeypatch.setattr(lk.common, "DEBUG_NAN_FILL", True)
        if ON_GPU and os.environ.get("HELM_TRITON_AUTOTUNE") != "1":
            monkeypatch.setattr(lk.common, "AUTOTUNE", False)
