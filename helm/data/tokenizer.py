"""A GPT-2 style byte-level BPE trained offline with ``tokenizers``.

Special tokens: ``<|endoftext|>`` (id 0) is bos *and* eos, ``<|pad|>`` (id 1) is pad. Padding has its own id
because ``transformers``' language-modeling collators set ``labels = -100`` wherever ``input_ids == pad``; with
pad == eos the model would never learn to end a document. The tokenizer adds no special tokens itself; packing
appends the eos. Chat template (saved with it, read by ``apply_chat_template`` and ``transformers serve``): one
``role: content`` line per message, then ``assistant:`` when a generation prompt is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .loading import load_text_dataset

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def train_tokenizer(files: str | os.PathLike | Iterable[str | os.PathLike], out_dir: str | os.PathLike, *,
                    vocab_size: int = 8192):
    """Train a byte-level BPE on ``files`` and ``save_pretrained`` it to ``out_dir``; returns the
    ``PreTrainedTokenizerFast`` (``AutoTokenizer.from_pretrained(out_dir)`` loads it offline).

    ``files`` are read with :func:`helm.data.load_text_dataset` (``.jsonl``: one text per record, field ``text``;
    ``.txt``: one text per file). ``vocab_size`` counts the 256 byte symbols and the two special tokens; a pair must
    occur twice to be merged.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    files = [Path(files)] if isinstance(files, (str, os.PathLike)) else [Path(f) for f in files]
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes + 2 special tokens), got {vocab_size}")
    texts = load_text_dataset(files)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((batch["text"] for batch in texts.iter(batch_size=1000)), trainer=trainer,
                                  length=len(texts))
    # Decoding must give back the exact text; transformers' clean-up would drop spaces before punctuation.
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                      pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False,
                                      chat_template=CHAT_TEMPLATE)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir))
    return wrapped
