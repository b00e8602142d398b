#!/usr/bin/env python
"""Perplexity of a causal LM over local text files, a folder of splits or a `datasets` dataset.

Documents, each followed by eos, form one stream cut into windows (pack_documents' rows unless --stride is
smaller); --document-attention scores them as train.py validates. See helm.evaluation and eval/README.md.

    python eval/perplexity.py --model runs/helm-d --files data/validation.jsonl --seq-len 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

from helm.evaluation import (MODEL_SPEC_HELP, add_loading_arguments, add_text_arguments, at_least,
                             check_window, check_writable, data_files, format_perplexity, load_checkpoint, model_names,
                             run_script, text_perplexity, texts_of, user_path, write_json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="[NAME=]PATH",
                        help=f"checkpoint folder (save_pretrained) or hub id; {MODEL_SPEC_HELP}")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer folder if not saved with the model")
    add_text_arguments(parser)
    parser.add_argument("--max-documents", type=at_least(1), metavar="N", help="read at most N documents")
    parser.add_argument("--seq-len", type=at_least(2), metavar="L",
                        help="window length (default: max_position_embeddings)")
    parser.add_argument("--stride", type=at_least(1), metavar="S", help="window start spacing (default: --seq-len)")
    parser.add_argument("--keep-last", action="store_true", help="also score the trailing partial window")
    parser.add_argument("--no-eos", action="store_true", help="do not put an eos token after each document")
    parser.add_argument("--max-tokens", type=at_least(1), metavar="N", help="use only the first N tokens of the stream")
    parser.add_argument("--max-windows", type=at_least(1), metavar="N", help="score only the first N windows")
    parser.add_argument("--document-attention", action="store_true",
                        help="packed rows, attention and positions restricted to each document (train.py)")
    parser.add_argument("--mask-document-starts", action="store_true",
                        help="no targets at document starts (train.py's data.mask_document_starts)")
    parser.add_argument("--batch-size", type=at_least(1), default=8)
    add_loading_arguments(parser)
    parser.add_argument("--output", type=user_path, metavar="JSON",
                        help="write the result here, a .json file (eval/compare.py reads it)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    [(name, path)] = model_names([args.model])
    if args.output:
        check_writable(args.output, "--output", inputs=data_files(args.data, args.split),
                       models=[path, *([args.tokenizer] if args.tokenizer else [])])
    texts = texts_of(args, max_documents=args.max_documents)
    model, tokenizer = load_checkpoint(path, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                                       trust_remote_code=args.trust_remote_code)
    if args.seq_len is not None:  # the default is the model's max_position_embeddings, which fits
        check_window(model, args.seq_len, "--seq-len")
    result = text_perplexity(model, tokenizer, texts, seq_len=args.seq_len,
                             stride=args.stride, batch_size=args.batch_size, keep_last=args.keep_last,
                             max_tokens=args.max_tokens, max_windows=args.max_windows, add_eos=not args.no_eos,
                             document_attention=args.document_attention,
                             mask_document_starts=args.mask_document_starts, progress=not args.no_progress)
    label = "+".join(Path(source).stem for source in args.data)
    if not Path(args.data[0]).is_file():  # a folder of splits or a hub dataset
        label += f"/{args.split}"
    task = f"perplexity:{label}"
    print(f"{name}  {task}  seq_len={result['seq_len']} stride={result['stride']}  tokens={result['scored_tokens']}  "
          f"mean NLL={result['mean_nll']:.4f}  perplexity={format_perplexity(result['perplexity'], 3)}")
    record = {"model_name": name, "model_path": path, "source": "eval/perplexity.py", "results": {task: result},
              "config": {key: value for key, value in vars(args).items() if key != "model"}}
    if args.output:
        write_json(args.output, record)
    return record


if __name__ == "__main__":
    run_script(main)
