"""Convert a checkpoint of the official HELM code into a ``save_pretrained`` folder of this zoo.

    python scripts/convert_official.py --checkpoint helm_mice_100m.pt --output converted/helm-mice-100m \\
        --tokenizer meta-llama/Llama-3.1-8B --set bos_token_id=128000 --set eos_token_id=128001

The checkpoint is read with ``torch.load(weights_only=True)`` (no code is unpickled). The converted model
computes the official model's logits (helm/convert.py lists the mapping and FIDELITY.md the switches it turns
on); the folder loads with ``AutoModelForCausalLM.from_pretrained`` (``trust_remote_code=True`` where helm is not
installed) and with ``lm_eval --model hf``. Exit status 2 on a bad checkpoint or argument, with one line naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Runnable from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helm.convert import MODELS, convert_official_checkpoint  # noqa: E402
from helm.data import check_path  # noqa: E402
from helm.data.paths import TOKENIZER_FILES  # noqa: E402
from helm.evaluation import user_path  # noqa: E402


def parse_setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, type=user_path, help="the official torch.save file")
    parser.add_argument("--output", required=True, type=user_path, help="folder to save_pretrained into")
    parser.add_argument("--model", choices=MODELS, help="official model kind (default: detected from the keys)")
    parser.add_argument("--tokenizer", help="tokenizer folder or hub name to save alongside (the official models "
                                            "use meta-llama/Llama-3.1-8B)")
    parser.add_argument("--set", type=parse_setting, action="append", default=[], metavar="KEY=VALUE",
                        help="config field on top of the converted config (JSON values), e.g. eos_token_id=128001")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the code a --tokenizer folder or hub tokenizer names in its auto_map (default: "
                             "refuse it)")
    args = parser.parse_args(argv)
    try:  # the paths first, before the checkpoint is read
        check_path(args.checkpoint, "--checkpoint", folder=False)
        if args.tokenizer:
            args.tokenizer = check_path(args.tokenizer, "--tokenizer", needs=TOKENIZER_FILES, hub=True)
        if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
            raise ValueError(f"--output {str(args.output)!r} exists and is not an empty folder")
        model = convert_official_checkpoint(args.checkpoint, model=args.model, **dict(args.set))
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        text = " ".join(str(error).split())
        hint = "; pass --trust-remote-code to run it, if you trust it" * ("trust_remote_code" in text)
        print(f"error: {text}{hint}", file=sys.stderr)
        return 2
    model.save_pretrained(args.output)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.output)
    print(f"converted {args.checkpoint} ({model.config.model_type}, {model.num_parameters():,} parameters) "
          f"into {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
