"""``dantinox import SOURCE --out runs/NAME [--dtype float32|bfloat16] [--max_context S] [--chat-template FILE]``.

SOURCE is a Hugging Face model directory (``dantinox.checkpoints.hf_dir``) or a ``.gguf`` file
(``dantinox.checkpoints.gguf_source.read_gguf``, which returns the same ``HFCheckpoint``). Without --dtype a
GGUF file's quantized matrices are kept in their block formats (``dantinox.quant.block_formats.BLOCK_FORMATS``; float32
compute; another block format is refused naming the tensor); ``--dtype float32`` (or bfloat16) dequantizes
every tensor to float32 as before, with one warning line naming the formats the block kernel would not run. Both end in
``dantinox.checkpoints.write_run_dir``, which writes an ordinary run directory atomically. Bad input (a
directory without config.json or weights, a missing shard, a tensor whose shape disagrees with the config, an
unsupported architecture or field) raises CheckpointError: one line, exit 2. It also prints the
token ids generation will stop at (merged from the checkpoint's files, case K11; ``dantinox.runs.stop_ids``),
and one line naming the chat template the run got (``dantinox.checkpoints.chat_template_choice``: the file given
with --chat-template, else the checkpoint's, else its architecture's built-in turn format, Gemma's, else none).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``dantinox import``."""
    p.add_argument("source", metavar="SOURCE", help="a Hugging Face model directory or a .gguf file")
    p.add_argument("--out", required=True, help="the new run directory (must not exist)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute and KV-cache dtype of the run, weights stored float32 (a GGUF file dequantized); "
                        "default float32, and a GGUF file's quantized weights kept in their block formats")
    p.add_argument("--max_context", type=int, default=None,
                   help="static cache slots (default: the checkpoint's context, at most 8192)")
    p.add_argument("--chat-template", dest="chat_template", metavar="FILE", default=None,
                   help="a Jinja chat template file for the run, instead of the checkpoint's own (or the built-in "
                        "turn format of its architecture when it carries none)")


def read_source(source: str, keep_blocks: bool = False):
    """The HFCheckpoint of SOURCE: a .gguf file through gguf_source (its blocks kept with keep_blocks),
    anything else as a HF directory."""
    from ..checkpoints.errors import CheckpointError

    if source.lower().endswith(".gguf"):
        try:
            from ..checkpoints.gguf_source import read_gguf
        except ImportError as err:
            raise CheckpointError(f"SOURCE {source}: GGUF import is not available in this build ({err})") from err
        if not os.path.isfile(source):
            raise CheckpointError(f"SOURCE {source} does not exist")
        return read_gguf(source, keep_blocks=keep_blocks)
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


def _weight_format(run_dir: str) -> str:
    """The run's weight format as model_summary.json records it ('float32', 'GGUF blocks Q4_1+Q8_0')."""
    from ..runs.run_dir import read_summary

    return read_summary(run_dir).get("weight_format", "float32")


def _dequantized_warning(source: str) -> str | None:
    """One warning line when a GGUF file dequantized for --dtype holds block formats the kernel lacks."""
    from ..checkpoints.gguf_source import open_reader
    from ..quant.block_formats import BLOCK_FORMATS

    lacking = sorted({t.tensor_type.name for t in open_reader(source).tensors}
                     - set(BLOCK_FORMATS) - {"F32", "F16", "BF16"})
    if not lacking:
        return None
    return (f"warning: {source} holds {', '.join(lacking)} blocks, which dantinox's block kernel does not run; "
            f"they are dequantized to float32 with the rest (--dtype given)")


def run_import(args) -> int:
    """Import SOURCE into --out; prints what was written. Raises CheckpointError / ValueError (exit 2)."""
    from ..checkpoints import write_run_dir
    from ..checkpoints.chat_template_choice import choose_template

    if args.max_context is not None and args.max_context < 1:
        raise ValueError(f"--max_context {args.max_context} is not allowed: an integer >= 1")
    if os.path.exists(args.out):
        raise ValueError(f"--out {args.out} already exists; choose a new run directory")
    start = time.perf_counter()
    ckpt = read_source(args.source, keep_blocks=args.dtype is None)
    archs = ckpt.config.get("architectures") if isinstance(ckpt.config, dict) else None
    template = choose_template(ckpt.chat_template, archs[0] if isinstance(archs, list) and archs else "",
                               getattr(args, "chat_template", None), ckpt.special_tokens)
    if args.dtype is not None and args.source.lower().endswith(".gguf"):
        warning = _dequantized_warning(args.source)
        if warning:
            print(warning, file=sys.stderr)
    spec = write_run_dir(args.out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, template.text,
                         ckpt.generation, dtype=args.dtype or "float32", max_context=args.max_context,
                         source=os.path.abspath(args.source), special_tokens=ckpt.special_tokens,
                         stop_tokens=template.stop_tokens, template_origin=template.origin)
    cfg = spec.cfg
    print(f"imported {spec.architecture} from {args.source} into {args.out} in "
          f"{time.perf_counter() - start:.1f} s: {cfg.num_blocks} blocks, dim {cfg.dim}, "
          f"attention {cfg.attention}, vocab {cfg.vocab_size}, dtype {cfg.compute_dtype}, "
          f"chat template {'yes' if template.text else 'no'}, weights {_weight_format(args.out)}")
    print(template.line)
    print(f"stops at token ids: {_stop_ids_line(args.out)}")
    if spec.context_note:
        print(spec.context_note)
    return 0
