"""``write_run_dir``: an imported checkpoint becomes an ordinary dantinox run directory, atomically.

The directory holds what ``dantinox.runs.run_dir.load_run`` reads (so generate, verify, eval, budget, serve,
plan and ``dx.Generator`` work unchanged) plus three files of imported models:

  config.json             ModelConfig.to_dict()
  model.safetensors       float32 parameters under run-directory names (see ``hf_weights``); a GGUF import
                          that keeps its blocks stores each block module's parts as ``<module>.parts.<i>.data``
                          (uint8 block rows, or float32 rows for "F32" parts) and their layout ({module: [[format,
                          N, M], ...]}) as JSON in the file's metadata (``dantinox.quant.block_linear``)
  tokenizer.json          the checkpoint's ``tokenizers`` file (padded with unused special tokens
                          ``<|dantinox_unused_N|>`` when the embedding has more rows than the tokenizer has ids)
  model_summary.json      parameters, KV bytes per token, tokenizer kind, ``imported_from``, ``architecture``,
                          ``stop_token_ids`` and ``stop_tokens`` (their texts), ``chat_template`` (where the
                          template came from, when the importer says), for reference, and ``weights_sha256`` (of
                          model.safetensors, checked on load: ``dantinox.runs.weights_checksum``)
  chat_template.jinja     the chat template, verbatim (only when the checkpoint has one)
  generation_config.json  the checkpoint's generation defaults as given (HF generation_config.json keys:
                          temperature, top_p, top_k, do_sample, bos_token_id, ...) plus ``eos_token_ids``: every
                          id that ends generation, merged (case K11): eos_token_id (one id or a list), then the
                          id of the tokenizer config's eos_token text, deduplicated, order kept; this is the
                          list generation stops at (``dantinox.runs.stop_ids``)
  tokenizer_config.json   the special token texts (bos_token, eos_token, unk_token, pad_token) the checkpoint
                          names, which a chat template reads (only when it names any)
  source_config.json      the source's config dict, for reference

Atomicity: everything is written into a hidden temporary directory beside ``out`` and renamed to ``out`` as
the last step; on any error the temporary directory is removed, so a failed import leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Any, Mapping

import numpy as np
import safetensors.numpy

from .._version import __version__
from ..kv.sizes import nominal_token_bytes
from ..model.transformer import abstract_transformer
from ..runs import weights_checksum
from ..runs.files import atomic_write_bytes, atomic_write_json
from ..runs.stop_ids import TOKENIZER_CONFIG, merge_stop_ids
from ..runs.tokenizer import TextTokenizer
from .errors import CheckpointError
from .hf_config import ImportSpec, import_spec
from ..quant.block_linear import LAYOUT_KEY
from .hf_weights import BlockParts, convert_weights

CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_FILE = "generation_config.json"
SOURCE_CONFIG_FILE = "source_config.json"
PAD_TOKEN = "<|dantinox_unused_{}|>"


def write_run_dir(out: str | os.PathLike, hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                  tokenizer_json: str, chat_template: str | None, generation: Mapping[str, Any] | None,
                  dtype: str = "float32", max_context: int | None = None, source: str = "",
                  special_tokens: Mapping[str, str] | None = None, stop_tokens: tuple = (),
                  template_origin: str | None = None) -> ImportSpec:
    """Convert a checkpoint and write it as the run directory ``out`` (which must not exist yet).

    The entry point of every importer (Hugging Face directory, GGUF file): the source reader produces
    transformers-style inputs and this function does the rest.

    Args:
      out: the new run directory (its parent is created if needed).
      hf_config: a transformers config.json dict (see ``hf_config`` for what is supported).
      tensors: HF tensor name -> array ([out, in] torch layout for linears), any float dtype.
      tokenizer_json: the text of a ``tokenizers`` tokenizer.json (BPE or WordLevel model).
      chat_template: the Jinja chat template text, or None.
      generation: generation defaults (HF generation_config.json keys), or None; ``eos_token_id`` (int or list)
        becomes ``eos_token_ids``, with the id of special_tokens["eos_token"] added.
      dtype: "float32" or "bfloat16": the run's compute and cache dtype (weights are stored float32, or as the
        blocks of ``BlockMatrix`` tensors, see the module docstring).
      max_context: static cache slots S; default the checkpoint's, at most hf_config.DEFAULT_MAX_CONTEXT.
      source: where the checkpoint came from (recorded in model_summary.json).
      special_tokens: {"bos_token", "eos_token", "unk_token", "pad_token"} -> text, as the checkpoint's
        tokenizer_config.json names them (or None).
      stop_tokens: token texts that also end generation (the chat template's end of turn, e.g. Gemma's
        ``<end_of_turn>``): their ids join the stop ids when the tokenizer holds them.
      template_origin: where chat_template came from (recorded in model_summary.json), or None.
    Returns the ImportSpec (its cfg is the run's ModelConfig; context_note a line worth printing, or None).
    Raises CheckpointError (one line): ``out`` exists or cannot be created, an unsupported config, a missing or
    misshapen tensor, an unreadable tokenizer or one with more ids than vocab_size, eos ids outside the vocabulary.
    OSError from the disk (the temporary directory is removed either way).
    """
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out):
        raise CheckpointError(f"--out {out} already exists; choose a new run directory")
    spec = import_spec(hf_config, dtype, max_context)
    params = convert_weights(tensors, spec)
    _check_against_model(params, spec)
    tokenizer = _tokenizer(tokenizer_json, spec.cfg.vocab_size)
    special = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str) and v}
    gen = _generation(generation, tokenizer, special.get("eos_token"), stop_tokens)
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.import-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as err:
        raise CheckpointError(f"--out {out}: cannot create the run directory there "
                              f"({err.strerror or type(err).__name__})") from None
    try:
        _write_files(tmp, spec, params, tokenizer, chat_template, gen, hf_config, source, special, template_origin)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return spec


def read_chat_template(run_dir: str | os.PathLike) -> str | None:
    """The run's chat template text, or None when it has none."""
    path = os.path.join(os.fspath(run_dir), CHAT_TEMPLATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_generation_config(run_dir: str | os.PathLike) -> dict:
    """The run's generation_config.json dict ({} when absent; ``eos_token_ids`` a list of ints when present)."""
    path = os.path.join(os.fspath(run_dir), GENERATION_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_against_model(params: Mapping[str, np.ndarray], spec: ImportSpec) -> None:
    """Every parameter of the model built from spec.cfg is present with its shape, and nothing else."""
    from flax import nnx

    abstract = abstract_transformer(spec.cfg)
    want = {".".join(str(p) for p in path): tuple(v.get_value().shape)
            for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    got = {k: tuple(v.shape) for k, v in params.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))
        raise CheckpointError(f"converted parameters disagree with the model built from the config at {diff[0]}")


def _tokenizer(text: str, vocab_size: int) -> TextTokenizer:
    try:
        tokenizer = TextTokenizer.from_json(text)
    except ValueError as err:
        raise CheckpointError(f"tokenizer.json: {err}") from err
    n = tokenizer.vocab_size
    if n > vocab_size:
        raise CheckpointError(f"tokenizer.json has {n} ids but config.json vocab_size={vocab_size}; the embedding "
                              "must have a row for every id")
    if n < vocab_size:
        from tokenizers import AddedToken

        tokenizer.hf.add_special_tokens([AddedToken(PAD_TOKEN.format(i), special=True)
                                         for i in range(n, vocab_size)])
        padded = TextTokenizer(tokenizer.hf, tokenizer.kind)
        if padded.vocab_size != vocab_size or padded.hf.token_to_id(PAD_TOKEN.format(vocab_size - 1)) != vocab_size - 1:
            raise CheckpointError(f"tokenizer.json: cannot pad {n} ids to vocab_size={vocab_size} contiguously")
        tokenizer = padded
    return tokenizer


def _generation(generation: Mapping[str, Any] | None, tokenizer: TextTokenizer, eos_token: str | None,
                stop_tokens: tuple = ()) -> dict:
    """The run's generation_config.json: ``generation`` plus eos_token_ids, the merged stop ids (K11), then
    the ids of ``stop_tokens`` the tokenizer holds."""
    gen = dict(generation or {})
    eos = gen.get("eos_token_id")
    try:
        ids = merge_stop_ids(tokenizer.vocab_size, eos)
    except ValueError:
        raise CheckpointError(f"generation_config.json: eos_token_id={eos!r} is not allowed: token ids in "
                              f"[0, vocab_size={tokenizer.vocab_size})") from None
    for text in ((eos_token,) if eos_token is not None else ()) + tuple(stop_tokens):
        token = tokenizer.hf.token_to_id(text)
        if token is not None and token not in ids:
            ids = ids + [token]
    gen["eos_token_ids"] = ids
    return gen


def stored_arrays(params: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """(the arrays model.safetensors holds, the block layout for its metadata): a BlockParts parameter
    ``<module>.kernel`` / ``embed.embedding`` becomes ``<module>.parts.<i>.data`` per part (a projection's bias,
    Qwen2's, stays ``<module>.bias``)."""
    arrays, layout = {}, {}
    for name, value in params.items():
        if not isinstance(value, BlockParts):
            arrays[name] = value
            continue
        module = name.rpartition(".")[0]
        layout[module] = [[p.fmt, p.n_out, p.n_in] for p in value.parts]
        for i, part in enumerate(value.parts):
            arrays[f"{module}.parts.{i}.data"] = np.ascontiguousarray(part.data)
    return arrays, layout


def weight_format(layout: dict) -> str:
    """'float32', or 'GGUF blocks Q4_1+Q8_0' (the formats of a block layout; "F32" parts not named)."""
    formats = sorted({fmt for parts in layout.values() for fmt, _, _ in parts if fmt != "F32"})
    return f"GGUF blocks {'+'.join(formats)}" if formats else "float32"


def _write_files(tmp: str, spec: ImportSpec, params, tokenizer: TextTokenizer, chat_template: str | None,
                 gen: dict, hf_config: Mapping[str, Any], source: str, special: dict,
                 template_origin: str | None = None) -> None:
    cfg = spec.cfg
    atomic_write_json(os.path.join(tmp, "config.json"), cfg.to_dict())
    arrays, layout = stored_arrays(params)
    metadata = {"format": "np", **({LAYOUT_KEY: json.dumps(layout)} if layout else {})}
    data = safetensors.numpy.save(arrays, metadata)
    atomic_write_bytes(os.path.join(tmp, "model.safetensors"), data)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    summary = {"dantinox_version": __version__, "parameters": int(sum(a.size for a in params.values())),
               "weight_format": weight_format(layout),
               "kv_bytes_per_token": nominal_token_bytes(cfg),
               "tokenizer": tokenizer.kind, "imported_from": source, "architecture": spec.architecture,
               "stop_token_ids": gen["eos_token_ids"],
               "stop_tokens": [tokenizer.hf.id_to_token(i) for i in gen["eos_token_ids"]],
               weights_checksum.KEY: weights_checksum.sha256_hex(data),
               **({"chat_template": template_origin} if template_origin else {})}
    atomic_write_json(os.path.join(tmp, "model_summary.json"), summary)
    atomic_write_json(os.path.join(tmp, GENERATION_FILE), gen)
    if special:
        atomic_write_json(os.path.join(tmp, TOKENIZER_CONFIG), special)
    atomic_write_json(os.path.join(tmp, SOURCE_CONFIG_FILE), dict(hf_config))
    if chat_template:
        atomic_write_bytes(os.path.join(tmp, CHAT_TEMPLATE_FILE), chat_template.encode("utf-8"))
