"""``dantinox import SOURCE --out runs/NAME [--dtype float32|bfloat16] [--max_context S]``.

SOURCE is a Hugging Face model directory (``dantinox.checkpoints.hf_dir``) or a ``.gguf`` file
(``dantinox.checkpoints.gguf_source.read_gguf``, which returns the same ``HFCheckpoint``). Both end in
``dantinox.checkpoints.write_run_dir``, which writes an ordinary run directory atomically. Bad input (a
directory without config.json or weights, a missing shard, a tensor whose shape disagrees with the config, an
unsupported architecture or field) raises CheckpointError: one line, exit 2. It also prints the
token ids generation will stop at (merged from the checkpoint's files, case K11; ``dantinox.runs.stop_ids``).
"""

from __future__ import annotations

import argparse
import os
import time


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``dantinox import``."""
    p.add_argument("source", metavar="SOURCE", help="a Hugging Face model directory or a .gguf file")
    p.add_argument("--out", required=True, help="the new run directory (must not exist)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute and KV-cache dtype of the run (weights are stored float32); default float32")
    p.add_argument("--max_context", type=int, default=None,
                   help="static cache slots (default: the checkpoint's context, at most 8192)")


def read_source(source: str):
    """The HFCheckpoint of SOURCE: a .gguf file through gguf_source, anything else as a HF directory."""
    from ..checkpoints.errors import CheckpointError

    if source.lower().endswith(".gguf"):
        try:
            from ..checkpoints.gguf_source import read_gguf
        except ImportError as err:
            raise CheckpointError(f"SOURCE {source}: GGUF import is not available in this build ({err})") from err
        if not os.path.isfile(source):
            raise CheckpointError(f"SOURCE {source} does not exist")
        return read_gguf(source)
    from ..checkpoints.hf_dir import read_hf_dir

    if not os.path.exists(source):
        raise CheckpointError(f"SOURCE {source} does not exist")
    return read_hf_dir(source)


def _stop_ids_line(run_dir: str) -> str:
    """The run's stop ids with their texts ('2 (<|im_end|>)'), as generation will use them."""
    from ..runs.stop_ids import describe_stop_ids, read_stop_ids
    from ..runs.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.load(os.path.join(run_dir, "tokenizer.json"))
    return describe_stop_ids(read_stop_ids(run_dir, tokenizer), tokenizer)


def run_import(args) -> int:
    """Import SOURCE into --out; prints what was written. Raises CheckpointError / ValueError (exit 2)."""
    from ..checkpoints import write_run_dir

    if args.max_context is not None and args.max_context < 1:
        raise ValueError(f"--max_context {args.max_context} is not allowed: an integer >= 1")
    if os.path.exists(args.out):
        raise ValueError(f"--out {args.out} already exists; choose a new run directory")
    start = time.perf_counter()
    ckpt = read_source(args.source)
    spec = write_run_dir(args.out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template,
                         ckpt.generation, dtype=args.dtype, max_context=args.max_context,
                         source=os.path.abspath(args.source), special_tokens=ckpt.special_tokens)
    cfg = spec.cfg
    print(f"imported {spec.architecture} from {args.source} into {args.out} in "
          f"{time.perf_counter() - start:.1f} s: {cfg.num_blocks} blocks, dim {cfg.dim}, "
          f"attention {cfg.attention}, vocab {cfg.vocab_size}, dtype {cfg.compute_dtype}, "
          f"chat template {'yes' if ckpt.chat_template else 'no'}")
    print(f"stops at token ids: {_stop_ids_line(args.out)}")
    if spec.context_note:
        print(spec.context_note)
    return 0
