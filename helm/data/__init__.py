"""Training and evaluation data: the offline default corpus, a byte-level BPE tokenizer, the one text loader
(:func:`load_text_dataset`) and the one packer (:func:`pack_documents`)."""

from .corpus import (DEFAULT_SOURCES, SOURCES, CorpusSource, MissingSourceError, build_corpus, build_default_data,
                     interrupted_build)
from .loading import load_text_dataset
from .packing import iter_packed, pack_documents, pack_rows, packed_inputs, tokenize
from .paths import check_path, looks_local, path_problem
from .tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer
