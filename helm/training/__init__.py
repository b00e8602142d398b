"""Library pieces of ``train.py``: the recipe (:mod:`.config`), training data (:mod:`.data`), one optimiser step
(:mod:`.step`), atomic checkpoints (:mod:`.checkpoint`) and the JSONL metrics tracker (:mod:`.tracking`)."""

from .checkpoint import (LOCK, CheckpointError, TrainerState, find_checkpoint, list_checkpoints,
                         output_lock, read_trainer_state, save_checkpoint, save_final, verify_checkpoint)
from .config import (ConfigError, RunConfig, all_keys, cli_overrides, describe, key_docs, load_run_config,
                     recipe_differences)
from .data import (PackedRows, StepRows, StreamRows, data_fingerprint, fingerprint_differences, load_splits,
                   load_tokenizer, pack_split, training_batches)
from .step import StepMetrics, train_step
from .tracking import JSONLTracker
