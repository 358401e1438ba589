"""A tiny run directory on disk, written by ``save_run``, for the tests of every package that load one (the
generator, the CLI, the server)."""

from conftest import spiky_model, tiny_config

from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer

TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura, ché la diritta via era smarrita.\n" * 3


def make_run(path, kind="char", **cfg_fields) -> str:
    """Write a run directory at ``path``: a ``kind`` tokenizer (char, or bpe of 260) trained on TEXT and a spiky
    tiny model (max_context 64 unless given) with ``cfg_fields``. Returns the path as a string."""
    tokenizer = train_tokenizer(TEXT, kind, 260 if kind == "bpe" else None)
    cfg = tiny_config(vocab_size=tokenizer.vocab_size, **{"max_context": 64, **cfg_fields})
    save_run(path, spiky_model(cfg, qk_scale=3.0), cfg, tokenizer)
    return str(path)
