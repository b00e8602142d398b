"""``transformers serve`` for HELM's model families: ``python -m helm.serve ARGS`` (or ``helm-serve ARGS``), with
exactly the arguments of ``transformers serve``.

The stock CLI loads a model with ``getattr(transformers, config.architectures[0])``, so a class that is only
registered with the Auto classes (as ``import helm`` registers HELM's) is not found and the server does not start.
This launcher, in its own process only, adds HELM's model classes to the ``transformers`` module namespace under
their class names (adding names, replacing none), then runs transformers' own CLI with ``serve`` prepended to the
arguments: the server, its endpoints, continuous batching and every flag are transformers' unchanged. ``import helm``
does none of this; it happens in :func:`main` only.

Before the server starts, a model argument that names a local path is checked (a missing folder, or one without
``config.json`` or tokenizer files, is one line naming it, exit 2), and a missing ``transformers[serving]`` install
is one line naming the extra to install.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from .data.paths import MODEL_FILES, TOKENIZER_FILES, check_path

SERVING_EXTRA = 'pip install -e ".[serving]"  (transformers[serving]: fastapi, uvicorn, openai)'


def model_classes() -> dict[str, type]:
    """HELM's model classes (base models, causal LMs and task heads of both families) by class name."""
    from transformers import PreTrainedModel

    from . import models

    found = {name: getattr(models, name) for name in models.__all__}
    return {name: cls for name, cls in found.items() if isinstance(cls, type) and issubclass(cls, PreTrainedModel)}


def expose_model_classes(namespace=None) -> list[str]:
    """Bind each of :func:`model_classes` on ``namespace`` (default: the ``transformers`` module) under its class
    name, so that ``getattr(transformers, config.architectures[0])`` finds it; returns the names added.

    A name already bound to the same class is left as it is; a name bound to anything else is a ``RuntimeError``
    naming it, before anything is added: nothing of transformers is replaced.
    """
    if namespace is None:
        import transformers as namespace
    classes = model_classes()
    missing = object()
    taken = [name for name, cls in classes.items() if getattr(namespace, name, missing) not in (missing, cls)]
    if taken:
        raise RuntimeError(f"transformers already defines {', '.join(taken)}; helm.serve replaces no name of it")
    added = [name for name, cls in classes.items() if getattr(namespace, name, missing) is missing]
    for name in added:
        setattr(namespace, name, classes[name])
    return added


def serve_command():
    """The click command of ``transformers serve`` (built from transformers' ``Serve`` as its CLI builds it), or
    ``SystemExit`` naming the extra to install when the serving dependencies are missing."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise SystemExit(f"helm.serve: transformers serve needs its serving dependencies: {SERVING_EXTRA}")
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer()
    app.command(name="serve")(Serve)
    return typer.main.get_command(app)


def check_model_argument(argv: Sequence[str]) -> None:
    """Parse ``argv`` as ``transformers serve`` does (without running it) and check a model argument that is a
    local path: ``SystemExit(2)`` with one line naming it when it is missing, a file, or a folder without
    ``config.json`` or tokenizer files. A hub id passes (the hub answers for it); a bad option is left to the CLI,
    which names it."""
    import click

    try:
        context = serve_command().make_context("helm.serve", list(argv), resilient_parsing=True)
    except click.ClickException:
        return
    model = context.params.get("force_model")
    if model is None:
        return
    try:
        check_path(model, "model", needs=MODEL_FILES, hub=True)
        check_path(model, "model (its tokenizer)", needs=TOKENIZER_FILES, hub=True)
    except ValueError as error:
        print(f"helm.serve: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServerProcess:
    """``python -m helm.serve MODEL ARGS --host HOST --port PORT`` in a child process that leads its own process
    group, its output (stdout and stderr) written to ``log``; ``port`` defaults to a free one.

    A context manager: on entry it returns once ``GET /health`` answers 200 (``RuntimeError`` with the log's tail
    when the process exits first or ``startup_timeout`` seconds pass); on exit, whatever happened, the whole group
    is stopped (SIGTERM, then SIGKILL after ``stop_timeout`` seconds), so no server outlives its user.
    """

    def __init__(self, model: str | os.PathLike, *args: str, host: str = "127.0.0.1", port: int | None = None,
                 log: str | os.PathLike, env: dict | None = None, startup_timeout: float = 120.0,
                 stop_timeout: float = 10.0):
        self.model, self.args, self.host = os.fspath(model), [str(a) for a in args], host
        self.port = free_port(host) if port is None else port
        self.log, self.env = Path(log), env
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:] if self.log.exists() else ""

    def launch(self) -> "ServerProcess":
        """Start the server's process without waiting for it (:meth:`wait_ready` waits)."""
        command = [sys.executable, "-m", "helm.serve", self.model, *self.args, "--host", self.host,
                   "--port", str(self.port)]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, start_new_session=True)
        return self

    def wait_ready(self) -> "ServerProcess":
        """Return once ``/health`` answers 200; ``RuntimeError`` with the log's tail when the process exits first or
        ``startup_timeout`` seconds (from now) pass, the server then stopped."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} before it answered; "
                                   f"{self.log}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer on {self.url}/health within {self.startup_timeout} s; "
                           f"{self.log}:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL if it is still there after ``stop_timeout``."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(self.stop_timeout)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "ServerProcess":
        try:
            return self.launch().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None):
    """Run ``transformers serve ARGV`` (default: this process's arguments) with HELM's model classes reachable on
    the ``transformers`` namespace of this process; returns when the server stops."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_model_argument(argv)
    expose_model_classes()
    from transformers.cli.transformers import main as transformers_cli

    sys.argv = ["transformers", "serve", *argv]
    return transformers_cli()


if __name__ == "__main__":
    sys.exit(main())
