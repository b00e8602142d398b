"""Library pieces of ``train.py``: the recipe (:mod:`.config`), training data (:mod:`.data`), atomic checkpoints
(:mod:`.checkpoint`) and the JSONL metrics tracker (:mod:`.tracking`)."""

from .checkpoint import (LOCK, CheckpointError, TrainerState, find_checkpoint, list_checkpoints, output_lock,
                         read_trainer_state, refused_pickles, save_checkpoint, save_final, verify_checkpoint)
from .config import ConfigError, RunConfig, all_keys, cli_overrides, load_run_config, recipe_differences
from .data import PackedRows, StreamRows, load_splits, load_tokenizer, pack_split
from .tracking import JSONLTracker
