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

import sys
from pathlib import Path
from collections.abc import Sequence

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


def main(argv: Sequence[str] | None = None):
    """Run ``transformers serve ARGV`` (default: this process's arguments) with HELM's model classes reachable on
    the ``transformers`` namespace of this process; returns when the server stops."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_model_argument(argv)
    expose_model_classes()
    # transformers' serve command under this launcher's name, which its usage and error lines then show
    prog = "helm-serve" if Path(sys.argv[0]).name == "helm-serve" else "python -m helm.serve"
    return serve_command().main(args=argv, prog_name=prog)


if __name__ == "__main__":
    sys.exit(main())
