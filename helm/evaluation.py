"""Scoring text with a causal LM: checkpoints and text in, token streams, windows, summed NLL and perplexity out.

``train.py`` reports validation perplexity with :func:`rows_nll` and :func:`perplexity`, and the ``eval/``
scripts build on the same functions, so a number printed during training and one printed by
``eval/perplexity.py`` on the same rows are the same computation.

Conventions: targets are ``labels`` shifted by one (``-100`` is never scored); log-softmax in fp32, sums in
fp64. Packed rows (``helm.data.pack_documents`` output: ``input_ids``, ``labels``, ``position_ids``,
``segment_ids``, all ``[N, L]``) are scored with document-causal attention, so no token sees another
document. :func:`sliding_windows` builds rows of the same layout (``input_ids``, ``labels``) from one token
stream, so every way of cutting text is scored by :func:`rows_nll`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from .data import check_path, packed_inputs
from .data.paths import MODEL_FILES, TOKENIZER_FILES

logger = logging.get_logger(__name__)

__all__ = ["EvalError", "add_loading_arguments", "add_text_arguments", "at_least", "check_model_folder",
           "check_vocabulary", "check_window", "check_writable",
           "data_files",
           "learned_position_limit", "load_checkpoint", "load_texts", "model_names", "perplexity",
           "rows_nll", "run_script", "shifted_nll", "sliding_windows", "split_model_spec", "text_perplexity",
           "texts_of", "token_stream", "with_rope_scaling", "write_json"]
REMOTE_CODE_HINT = "pass --trust-remote-code to run it, if you trust it"


class EvalError(ValueError):
    """A bad argument, or a checkpoint or text that cannot be read; the ``eval/`` scripts print it as one line."""


def run_script(main: Callable, argv: Optional[list[str]] = None):
    """Run an ``eval/`` script's ``main``: an :class:`EvalError` becomes one ``error: ...`` line on stderr and exit
    status 2, the convention of argparse (whose own usage errors exit 2 too)."""
    try:
        return main(argv)
    except (EvalError, OSError) as error:  # OSError: an unwritable --output, a full disk
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def user_path(text: str) -> Path:
    """An ``argparse`` ``type`` for a path option: ``text`` with a leading ``~`` expanded. The shell expands an unquoted
    ``~`` only; a quoted one (``--output '~/r.json'``) would otherwise create a folder named ``~`` in the current
    directory."""
    return Path(text).expanduser()


def check_writable(path, name: str, *, folder: bool = False, files: Iterable[str] = (),
                   inputs: Iterable = (), models: Iterable = ()) -> Path:
    """``path`` as a ``Path`` once it is known that a result can be written there (``folder``: into it), else an
    :class:`EvalError` naming the option: checked before any model is loaded, so that an unwritable ``--output``
    does not fail after the whole run. Creates the missing parent folders (or the folder), as writing would.

    Nothing the run reads is overwritten: ``path`` (for a ``folder``, each of the ``files`` named there) must not be
    one of ``inputs`` (files; symlinks resolved, hard links compared by inode), and must not be or lie inside one
    of the ``models`` (checkpoint folders; a hub id or any other name that is not a local folder is skipped).
    """
    path = Path(path)
    real = Path(os.path.realpath(path))
    for model in models:
        model_dir = Path(os.path.realpath(Path(os.fspath(model)).expanduser()))
        if model_dir.is_dir() and (real == model_dir or model_dir in real.parents):
            raise EvalError(f"{name} {str(path)!r} is in the model folder {os.fspath(model)!r}, whose files it "
                            "could overwrite; choose a path outside it")
    for target in [path / file for file in files] if folder else [path]:
        for source in inputs:
            if _same_file(target, Path(os.fspath(source)).expanduser()):
                raise EvalError(f"{name} {str(target)!r} is the input file {os.fspath(source)!r} of this run, which "
                                "writing the result would destroy; choose another path")
    where = path if folder else path.parent
    try:
        if path.exists() and path.is_dir() != folder:
            raise EvalError(f"{name} {str(path)!r} is {'a file' if folder else 'a folder'}; expected "
                            f"{'a folder' if folder else 'a file path'}")
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".write-test-"):
            pass
        if path.exists() and not folder and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is read-only")
    except OSError as error:
        raise EvalError(f"{name} {str(path)!r} is not writable ({error}); choose another path") from None
    return path


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing ``a`` would write ``b``: the same path once symlinks are resolved, or a hard link of it."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def data_files(sources: Iterable, split: str) -> list[Path]:
    """The local files :func:`load_texts` reads for ``sources`` (a folder: its ``{split}`` file), for
    :func:`check_writable`'s ``inputs``; a hub dataset name reads no local file."""
    from helm.data.loading import BUILDERS

    files = []
    for source in sources:
        path = Path(os.fspath(source)).expanduser()
        candidates = [path / f"{split}{suffix}" for suffix in BUILDERS] if path.is_dir() else [path]
        files += [file for file in candidates if file.is_file()]
    return files


MODEL_SPEC_HELP = ("NAME=PATH labels the result NAME; an argument that exists as a path, or whose part before the "
                   "first '=' holds a '/' (a label never does), is all PATH, '=' and all")


def split_model_spec(spec: str) -> tuple[str, str]:
    """``(NAME, PATH)`` of a ``[NAME=]PATH`` argument, ``NAME`` ``""`` when there is none (:data:`MODEL_SPEC_HELP`).

    The whole argument is the path when it exists as one (a folder ``runs/lr=0.1``), or when the part before the
    first ``=`` holds a ``/`` or ``\\`` (``/tmp/x/a=b``): a label never does, and splitting there would take the
    tail after ``=`` for the path. Otherwise NAME is the part before the first ``=``, PATH the rest (which may hold
    more ``=``; an empty NAME, ``=PATH``, is no label)."""
    name, sep, path = spec.partition("=")
    if not sep or "/" in name or "\\" in name or Path(spec).expanduser().exists():
        return "", spec
    if not path.strip():
        raise EvalError(f"--model {spec!r} has no path after {name}=: pass NAME=PATH (a folder written by "
                        "save_pretrained or a hub model id)")
    return name, path


def model_names(specs: Iterable[str]) -> list[tuple[str, str]]:
    """``(name, path)`` of each ``[NAME=]PATH`` ``--model`` (:func:`split_model_spec`; name: NAME, else the folder's
    name), refusing two models of one run with the same name: their results and output files would be merged or
    overwrite each other."""
    pairs, seen = [], {}
    for spec in specs:
        name, path = split_model_spec(spec)
        name = name or Path(path.rstrip("/")).name
        if name in seen:
            raise EvalError(f"--model {seen[name]!r} and --model {spec!r} are both named {name!r}, so their results "
                            "would be merged; label them NAME=PATH")
        seen[name] = spec
        pairs.append((name, path))
    return pairs


def at_least(low: int) -> Callable[[str], int]:
    """An ``argparse`` ``type``: an integer that is at least ``low``; argparse names the option and exits 2
    otherwise."""
    def parse(text: str) -> int:
        value = int(text)  # argparse reports the ValueError as an invalid value
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def perplexity(mean_nll: float) -> float:
    """``exp(mean NLL)``, saturating instead of overflowing for a diverged model."""
    return math.exp(min(float(mean_nll), 700.0))


def format_perplexity(value: float, decimals: int = 1) -> str:
    """A perplexity for people: ``1,234.5`` below 1e6 (``decimals`` after the point), scientific notation
    (``3.210e+300``) from 1e6 on, where a diverged model's hundreds of digits would say nothing more."""
    return f"{value:,.{decimals}f}" if value < 1e6 else f"{value:.3e}"


def shifted_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL (fp64) of ``labels[:, 1:]`` under ``logits[:, :-1]`` (fp32 log-softmax) and the target count."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            ignore_index=-100, reduction="sum")
    return nll.double(), (targets != -100).sum().double()


@torch.no_grad()
def rows_nll(model, rows: dict[str, torch.Tensor], *, batch_size: int = 8, document_attention: bool = True,
             rank: int = 0, world_size: int = 1, autocast: Optional[Callable] = None, progress: bool = False,
             desc: str = "perplexity") -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL and number of scored targets over packed ``rows``, as fp64 tensors on the model's device.

    Each process scores every ``world_size``-th row starting at ``rank``; the caller sums the two tensors
    across processes (``accelerator.reduce``) and divides. ``document_attention=False`` feeds ``input_ids``
    alone (plain causal attention over the whole row). ``autocast`` is a context-manager factory (e.g.
    ``accelerator.autocast``). The model is put in eval mode and restored.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    mine = torch.arange(rank, rows["input_ids"].shape[0], world_size)
    for start in tqdm(range(0, mine.numel(), batch_size), desc=desc, unit="batch", disable=not progress):
        batch = {key: value[mine[start:start + batch_size]].to(device) for key, value in rows.items()}
        inputs = packed_inputs(model, batch) if document_attention else {"input_ids": batch["input_ids"]}
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(**inputs, use_cache=False).logits
        nll, n = shifted_nll(logits, batch["labels"])
        total += nll
        count += n
    model.train(was_training)
    return total, count


def token_stream(texts: Iterable[str], tokenizer, *, eos_id: Optional[int]) -> torch.Tensor:
    """``[T]`` ids: each document tokenized without special tokens and followed by ``eos_id`` (unless None).

    With an eos this is the stream ``helm.data.pack_documents`` cuts into rows.
    """
    ids: list[int] = []
    for doc in tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]:
        ids += doc if eos_id is None else [*doc, eos_id]
    return torch.tensor(ids, dtype=torch.long)


def sliding_windows(ids: torch.Tensor, seq_len: int, stride: Optional[int] = None, *,
                    keep_last: bool = False) -> dict[str, torch.Tensor]:
    """Rows ``input_ids`` and ``labels`` (``[N, W]``) of windows of at most ``seq_len`` tokens over ``ids``.

    ``stride = seq_len`` (default): consecutive non-overlapping windows, the rows of ``pack_documents``;
    the trailing partial window is dropped unless ``keep_last``. ``stride < seq_len``: windows start every
    ``stride`` tokens until one reaches the end, and each labels only the tokens no earlier window labelled,
    so every token but the first is scored once, with at least ``seq_len - stride`` tokens of context
    (``stride = 1``: exactly ``seq_len - 1``). Short windows are right-padded with ``-100`` labels, which a
    causal model cannot see.
    """
    stride = seq_len if stride is None else stride
    if seq_len < 2:
        raise EvalError(f"seq_len must be at least 2 (one context token and one target), got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise EvalError(f"stride must lie in [1, seq_len={seq_len}], got {stride}")
    n = ids.numel()
    spans = []  # (begin, end, first labelled token); a row's first label is context only, never a target
    if stride == seq_len:
        spans = [(begin, min(begin + seq_len, n), begin) for begin in range(0, n, seq_len)]
        spans = [(b, e, f) for b, e, f in spans if e - b == seq_len or (keep_last and e - b >= 2)]
    else:
        labelled_until = 0
        for begin in range(0, max(n - 1, 1), stride):
            end = min(begin + seq_len, n)
            if end - begin >= 2:
                spans.append((begin, end, max(labelled_until, begin)))
                labelled_until = end
            if end == n:
                break
    width = max((end - begin for begin, end, _ in spans), default=seq_len)
    input_ids = torch.zeros(len(spans), width, dtype=torch.long)
    labels = torch.full((len(spans), width), -100, dtype=torch.long)
    for row, (begin, end, first) in enumerate(spans):
        input_ids[row, :end - begin] = ids[begin:end]
        labels[row, first - begin:end - begin] = ids[first:end]
    return {"input_ids": input_ids, "labels": labels}


def text_perplexity(model, tokenizer, texts: list[str], *, seq_len: Optional[int] = None, stride: Optional[int] = None,
                    batch_size: int = 8, keep_last: bool = False, max_tokens: Optional[int] = None,
                    max_windows: Optional[int] = None, add_eos: bool = True, document_attention: bool = False,
                    mask_document_starts: bool = False, progress: bool = False) -> dict:
    """Mean token NLL and perplexity of ``model`` on ``texts``, with its counts, as a result-file record.

    The documents become one stream (:func:`token_stream`) cut by :func:`sliding_windows`, attention crossing
    document boundaries as in plain ``model(input_ids)``. ``document_attention`` or ``mask_document_starts``
    score ``pack_documents`` rows instead, the way ``train.py`` validates (``max_windows`` is its
    ``train.eval_rows``). ``seq_len`` defaults to the model's ``max_position_embeddings``.
    """
    seq_len = model.config.max_position_embeddings if seq_len is None else seq_len
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens), ("max_windows", max_windows)):
        if value is not None and value < 1:  # 0 would crash deep inside, or blame the text for being too short
            raise EvalError(f"{name} must be at least 1, got {value}")
    eos_id = tokenizer.eos_token_id if add_eos else None
    if add_eos and eos_id is None:
        raise EvalError("the tokenizer has no eos token to separate documents; set add_eos=False (--no-eos)")
    if document_attention or mask_document_starts:
        if stride not in (None, seq_len) or keep_last or max_tokens is not None or not add_eos:
            raise EvalError("document_attention / mask_document_starts score packed rows: they do not combine "
                            "with stride, keep_last, max_tokens or add_eos=False")
        from helm.data import pack_documents

        token_lists = tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = pack_documents(token_lists, seq_len, eos_id=eos_id, mask_document_starts=mask_document_starts)
        stream_tokens = sum(len(tokens) + 1 for tokens in token_lists)
    else:
        ids = token_stream(texts, tokenizer, eos_id=eos_id)[:max_tokens]
        rows, stream_tokens = sliding_windows(ids, seq_len, stride, keep_last=keep_last), ids.numel()
    rows = {key: value[:max_windows] for key, value in rows.items()}
    windows = rows["input_ids"].shape[0]
    if windows == 0:
        raise EvalError(f"the text has {stream_tokens} tokens, fewer than one window of seq_len={seq_len}")
    logger.info("scoring %d windows of %d tokens", windows, seq_len)
    nll, count = rows_nll(model, rows, batch_size=batch_size, document_attention=document_attention,
                          progress=progress)
    mean = float(nll / count)
    return {"mean_nll": mean, "perplexity": perplexity(mean), "bits_per_token": mean / math.log(2),
            "scored_tokens": int(count), "stream_tokens": stream_tokens, "windows": windows, "seq_len": seq_len,
            "stride": stride or seq_len, "document_attention": document_attention}


# transformers' names of a learned table of absolute positions (GPT-2 and GPT-Neo: wpe; OPT, BioGPT: embed_positions)
_POSITION_TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings")


def learned_position_limit(model) -> Optional[int]:
    """The most positions ``model`` takes when a learned table of absolute positions bounds them (HELM's
    ``positional: learned``, GPT-2's ``wpe``, OPT's ``embed_positions``): its ``max_position_embeddings``. None
    when its encoding computes any position (rotary, ALiBi, sinusoidal, none): longer windows are then an
    extrapolation to measure, not an index past a table."""
    for name, module in model.named_modules():
        helm_table = getattr(module, "absolute", False) and isinstance(getattr(module, "max_positions", None), int)
        if helm_table or (isinstance(module, torch.nn.Embedding) and name.rpartition(".")[2] in _POSITION_TABLE_NAMES):
            limit = getattr(model.config, "max_position_embeddings", None)
            return limit if isinstance(limit, int) else (module.max_positions if helm_table else module.num_embeddings)
    return None


def check_window(model, length: int, option: str) -> None:
    """An :class:`EvalError` when windows of ``length`` tokens (the value of ``option``) run past ``model``'s
    learned position table (:func:`learned_position_limit`), checked before any window is scored: the model would
    fail on the first one (an index error for transformers' models)."""
    limit = learned_position_limit(model)
    if limit is not None and length > limit:
        advice = f"; use {option} <= {limit}" if option.startswith("--") else ""
        raise EvalError(f"{option}={length} is longer than the model's learned position table "
                        f"(max_position_embeddings={limit}), which has no row for later positions{advice}")


def add_loading_arguments(parser) -> None:
    """The ``eval/`` scripts' options of :func:`load_checkpoint`: ``--device``, ``--dtype``, ``--trust-remote-code``."""
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64", "auto"),
                        help="weights' dtype (default float32)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the code saved with a checkpoint of a model type neither helm nor transformers has")


def check_model_folder(path: str | os.PathLike, tokenizer: Optional[str | os.PathLike] = None) -> tuple[str, str]:
    """``(model, tokenizer)`` paths (``~`` expanded; a hub id unchanged) once ``path`` is a folder with a
    config.json and the tokenizer folder (``tokenizer``, else ``path``) one with tokenizer files: checked before
    the weights load, which can take minutes. An :class:`EvalError` naming the option otherwise."""
    path = check_path(path, "--model", EvalError, needs=MODEL_FILES, hub=True)
    if tokenizer is not None:
        return path, check_path(tokenizer, "--tokenizer", EvalError, needs=TOKENIZER_FILES, hub=True)
    return path, check_path(path, "--model (its tokenizer; or pass --tokenizer)", EvalError, needs=TOKENIZER_FILES,
                            hub=True)


def loaded(option: str, name: str, load: Callable):
    """``load(name)``, or an :class:`EvalError` naming ``option`` and ``name`` for what the loader raises for a
    folder or hub id it cannot read (``OSError``, ``ValueError``)."""
    try:
        return load(name)
    except (OSError, ValueError) as error:
        hint = f" ({REMOTE_CODE_HINT})" * ("trust_remote_code" in str(error))
        raise EvalError(f"{option} {name!r}: {' '.join(str(error).split())}{hint}") from None


def load_checkpoint(path: str | os.PathLike, *, tokenizer: Optional[str | os.PathLike] = None,
                    device: Optional[str] = None, dtype: str = "float32", trust_remote_code: bool = False):
    """``(model, tokenizer)`` from a ``save_pretrained`` folder or hub id, the model in eval mode on ``device``.

    Importing ``helm`` registered the HELM model types, so HELM folders load with our own code, never the code
    saved with them, and ``transformers`` models load as usual. Code saved with any other checkpoint runs only
    with ``trust_remote_code``. ``dtype``: ``float32``, ``bfloat16``, ``float16``, ``float64`` or ``auto``.
    A tokenizer with more tokens than the model's vocabulary is refused (:func:`check_vocabulary`).
    """
    path, tokenizer = check_model_folder(path, tokenizer)
    device = check_device(device)
    model = loaded("--model", path, lambda name: AutoModelForCausalLM.from_pretrained(
        name, dtype=dtype, trust_remote_code=trust_remote_code))
    tok = loaded("--tokenizer", tokenizer, lambda name: AutoTokenizer.from_pretrained(
        name, trust_remote_code=trust_remote_code))
    check_vocabulary(model, tok, f"the tokenizer {tokenizer!r}")
    return model.to(device).eval(), tok


def check_vocabulary(model, tokenizer, source: str) -> None:
    """An :class:`EvalError` when ``tokenizer`` (``source`` names where it came from) has more tokens than
    ``model``'s ``config.vocab_size``: its ids past the embedding table would fail the first forward, after the
    text was read (``train.py`` refuses such a ``data.tokenizer`` the same way). A config without an integer
    ``vocab_size`` is not checked."""
    vocab_size = getattr(model.config, "vocab_size", None)
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise EvalError(f"{source} has {len(tokenizer)} tokens but the model has vocab_size={vocab_size}: ids past "
                        "its embedding table cannot be scored; use the tokenizer the model was trained with")


ROPE_SCALINGS = ("none", "linear", "dynamic", "yarn", "longrope", "resonance")


def with_rope_scaling(model, scaling: str, factor: float, original_length: int):
    """``model`` evaluated at ``factor`` x its training length ``original_length`` with a RoPE scaling applied at
    inference: the same weights in a model rebuilt from its config with ``rope_parameters`` set as for Llama
    (``transformers.modeling_rope_utils`` computes the frequencies, for HELM models too), or ``model`` itself for
    ``none`` and for ``factor <= 1``.

    ``scaling``: ``linear`` (position interpolation), ``dynamic`` (dynamic NTK), ``yarn``, ``longrope`` (no searched
    factors here: short factors 1 and long factors ``factor`` for every frequency, i.e. position interpolation
    past ``original_length``; searched ones go in a config by hand) or ``resonance`` (HELM only: integer
    wavelengths on the unscaled frequencies). Raises :class:`EvalError` for an unknown scaling or a model whose
    encoding takes none (the caller records it as a note).
    """
    if scaling not in ROPE_SCALINGS:
        raise EvalError(f"rope scaling must be one of {ROPE_SCALINGS}, got {scaling!r}")
    if scaling == "none" or factor <= 1:
        return model
    helm_model = hasattr(model.config, "positional_dims")
    if scaling == "resonance" and not helm_model:
        raise EvalError("resonance scaling is HELM's (transformers has no such rope_type)")
    params = dict(getattr(model.config, "rope_parameters", None) or {})
    params.update(rope_type=scaling, factor=float(factor))
    # linear and dynamic take no original length, except 3D-RPE's interpolation (linear on rope3d)
    rope3d_linear = scaling == "linear" and getattr(model.config, "positional", None) == "rope3d"
    if scaling in ("yarn", "longrope", "resonance") or rope3d_linear:
        params["original_max_position_embeddings"] = original_length
    if scaling == "resonance":
        params.update(rope_type="default", resonance=True)
        del params["factor"]
    elif scaling == "longrope":
        # rotated space dims per head: HELM configs list them, Llama rotates its whole head_dim
        dims = model.config.positional_dims() if helm_model else {"": model.config.head_dim}
        pairs = min(dims.values()) // 2
        params.update(short_factor=[1.0] * pairs, long_factor=[float(factor)] * pairs)
    config = model.config.to_dict()
    # dynamic NTK reads the training length from max_position_embeddings; YaRN checks factor against their ratio
    config.update(rope_parameters=params, max_position_embeddings=original_length * (1 if scaling == "dynamic" else
                                                                                      math.ceil(factor)))
    try:
        config = type(model.config).from_dict(config)
        scaled = type(model)(config)
    except (ValueError, KeyError, TypeError) as error:
        raise EvalError(f"{scaling} scaling: {' '.join(str(error).split())}") from error
    scaled.load_state_dict(model.state_dict())
    return scaled.to(device=model.device, dtype=model.dtype).eval()


def check_device(device: Optional[str]) -> torch.device:
    """``device`` (default: cuda if available, else cpu) if this machine has it, else an :class:`EvalError`."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise EvalError(f"--device {device!r} is not a torch device ({error})") from None
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise EvalError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    backend = getattr(torch, device.type, None)  # torch.mps, torch.xpu, ...; none for xla, meta, hpu
    if device.type not in ("cpu", "cuda") and not (hasattr(backend, "is_available") and backend.is_available()):
        raise EvalError(f"--device {device}: not available on this machine")
    return device


def add_text_arguments(parser) -> None:
    """The ``eval/`` scripts' options of :func:`texts_of`: the text, its split, field and hub configuration."""
    parser.add_argument("--files", "--dataset", dest="data", nargs="+", required=True, metavar="SOURCE",
                        help="text files (.jsonl: one document per record; .txt: one per file), a folder holding "
                             "{split}.jsonl, or a datasets name such as wikitext")
    parser.add_argument("--dataset-config", help="datasets configuration, e.g. wikitext-2-raw-v1")
    parser.add_argument("--split", default="test", help="split of a folder or dataset (default: test)")
    parser.add_argument("--text-column", default="text", help="field holding the text (default: text)")


def texts_of(args, **options) -> list[str]:
    """:func:`load_texts` of the options :func:`add_text_arguments` added; ``options`` go to it."""
    hub = {"name": args.dataset_config} if args.dataset_config else {}
    return load_texts(args.data, args.split, text_column=args.text_column, **options, **hub)


def load_texts(source: str | os.PathLike | list, split: str = "test", *, text_column: str = "text",
               max_documents: Optional[int] = None, **hub_kwargs) -> list[str]:
    """Non-empty documents from ``helm.data.load_text_dataset``: files, a folder of splits or a hub dataset.

    ``.jsonl``/``.json``: one document per record (field ``text_column``); ``.txt``: the whole file is one
    document. ``hub_kwargs`` (e.g. ``name="wikitext-2-raw-v1"``) go to ``datasets.load_dataset``.
    """
    from helm.data import load_text_dataset

    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    missing = [str(s) for s in sources if Path(s).suffix and not Path(s).exists()]
    if missing:
        raise EvalError(f"text file not found: {', '.join(missing)}")
    try:
        data = load_text_dataset(sources[0] if len(sources) == 1 else sources, split, text_column=text_column,
                                 **hub_kwargs)
    except (OSError, KeyError, ValueError, RuntimeError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise EvalError(f"could not read text_column={text_column!r} of {source} (split {split!r}): "
                        f"{message}") from error
    if data.column_names is not None and text_column not in data.column_names:
        raise EvalError(f"{source} has no column text_column={text_column!r} (columns: {data.column_names})")
    texts = (record[text_column] for record in data)
    if max_documents is not None and max_documents < 1:
        raise EvalError(f"max_documents must be at least 1, got {max_documents}")
    texts = list(itertools.islice((text for text in texts if text and text.strip()), max_documents))
    if not texts:
        raise EvalError(f"no text in {source} (split {split!r}): every document is empty")
    return texts


def write_json(path: str | os.PathLike, record) -> Path:
    """Write a result record (lm-eval's layout ``{"model_name", "results": {task: {metric: value}}}``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return path
