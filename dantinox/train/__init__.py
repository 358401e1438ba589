"""Training: data, trainer, checkpoints, init_from and training on a mesh (sharded.py; one concept per module).

The run directory and the tokenizer live in ``dantinox.runs`` (``dantinox train`` in
``dantinox/cli/train.py``); they are re-exported here so ``from dantinox.train import load_run`` keeps working.

    from dantinox.train import train, load_run
    summary = train(ModelConfig.from_preset("dante"), "text.txt", "runs/r1", steps=2000, seq_len=256)
    model, cfg, tokenizer, summary = load_run("runs/r1")
"""

from ..runs.files import atomic_write_bytes
from ..runs.run_dir import RunDirError, load_run, read_summary, save_run
from ..runs.tokenizer import StreamDecoder, TextTokenizer, train_tokenizer
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .data import DataError, TokenData, read_text, sample_batch, split_text, val_batches
from .init_from import InitFromError, init_from_run
from .trainer import TrainConfig, TrainError, train

__all__ = [
    "CheckpointError", "DataError", "InitFromError", "RunDirError", "StreamDecoder", "TextTokenizer",
    "TokenData", "TrainConfig", "TrainError", "atomic_write_bytes", "init_from_run", "load_checkpoint",
    "load_run", "read_summary", "read_text", "sample_batch", "save_checkpoint", "save_run", "split_text",
    "train", "train_tokenizer", "val_batches",
]
