"""The run directory: everything needed to use a trained model, in standard formats.

  config.json          ``ModelConfig.to_dict()``; loadable with ``ModelConfig.from_dict`` (nothing else in it)
  model.safetensors    float32 parameters; keys are the nnx parameter paths joined by "."
                       (for example ``blocks.0.attn.qkv.kernel``); an imported GGUF's block weights are uint8
                       ``<module>.parts.<i>.data`` with their layout in the file's metadata
                       (``dantinox.quant.block_linear``), rebuilt as BlockLinear / BlockEmbed modules on load
  tokenizer.json       the Hugging Face ``tokenizers`` file (see ``dantinox.runs.tokenizer``)
  model_summary.json   parameter count, KV-cache bytes per token, validation loss, training time, tokens
                       seen, steps, tokenizer kind, data file name and SHA-256, dantinox version, and
                       ``weights_sha256``: the SHA-256 of model.safetensors, checked on load
                       (``dantinox.runs.weights_checksum``)
  training_log.csv     one row per evaluation: step, lr, train_loss, val_loss, tokens_per_s, elapsed_s

Every file is written atomically (temporary file, fsync, ``os.replace``). :func:`load_run` checks each file
and raises :class:`RunDirError` naming the file and the problem instead of failing deep inside JAX.
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from ..config import ModelConfig
from ..parallel.distributed import to_host
from ..model.transformer import Transformer, abstract_transformer
from .files import atomic_write_bytes, atomic_write_json
from .tokenizer import TextTokenizer
from . import weights_checksum as checksum
from .input_files import InputFileNotFound, read_json
from .._version import __version__
from ..kv.sizes import nominal_token_bytes
from .bundled import bundled_names, resolve_run_dir
from ..quant.block_formats import check_blocks
from ..quant.block_linear import LAYOUT_KEY, apply_block_layout

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
SUMMARY_FILE = "model_summary.json"
LOG_FILE = "training_log.csv"
LOG_COLUMNS = ("step", "lr", "train_loss", "val_loss", "tokens_per_s", "elapsed_s")


class RunDirError(ValueError):
    """A run directory is missing a file, holds a corrupt file, or its files disagree with each other."""


def param_arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every nnx.Param of ``model`` as a host float32 array, keyed by its path joined with "."."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(p) for p in path): to_host(var.get_value()).astype(np.float32) for path, var in flat}


def count_params(model: nnx.Module) -> int:
    """Total number of parameter elements."""
    return int(sum(a.size for a in param_arrays(model).values()))


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV-cache bytes one token occupies over all layers, in cfg.cache_dtype."""
    return nominal_token_bytes(cfg)


def save_run(out_dir: str | os.PathLike, model: nnx.Module, cfg: ModelConfig, tokenizer: TextTokenizer,
             extra_summary: dict[str, Any] | None = None) -> None:
    """Write config.json, model.safetensors, tokenizer.json and model_summary.json into ``out_dir``.

    extra_summary: JSON-serialisable entries merged into model_summary.json (val_loss, steps, ...).
    Raises RunDirError if the tokenizer's vocab_size differs from cfg.vocab_size; OSError from the disk.
    """
    if tokenizer.vocab_size != cfg.vocab_size:
        raise RunDirError(f"tokenizer vocab_size {tokenizer.vocab_size} != config vocab_size "
                          f"{cfg.vocab_size}")

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    arrays = param_arrays(model)
    atomic_write_json(os.path.join(out_dir, CONFIG_FILE), cfg.to_dict())
    data = safetensors.numpy.save(arrays, {"format": "np"})
    atomic_write_bytes(os.path.join(out_dir, WEIGHTS_FILE), data)
    tokenizer.save(os.path.join(out_dir, TOKENIZER_FILE))
    summary = {"dantinox_version": __version__, "parameters": int(sum(a.size for a in arrays.values())),
               "kv_bytes_per_token": kv_bytes_per_token(cfg), "tokenizer": tokenizer.kind,
               **(extra_summary or {}), checksum.KEY: checksum.sha256_hex(data)}
    atomic_write_json(os.path.join(out_dir, SUMMARY_FILE), summary)


def append_log_row(out_dir: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append one row (keys: LOG_COLUMNS) to training_log.csv, writing the header for a new file."""
    path = os.path.join(os.fspath(out_dir), LOG_FILE)
    new = not os.path.exists(path)
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=LOG_COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def truncate_log(out_dir: str | os.PathLike, last_step: int) -> None:
    """Drop training_log.csv rows after ``last_step`` (logged after the checkpoint a run resumes from)."""
    path = os.path.join(os.fspath(out_dir), LOG_FILE)
    if not os.path.exists(path):
        return
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) <= last_step]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"))


def load_run(run_dir: str | os.PathLike, verify: bool = True) -> tuple[Transformer, ModelConfig, TextTokenizer,
                                                                      dict]:
    """Load a run directory written by :func:`save_run`, or a bundled model by name (a path that does not
    exist but names one, see ``dantinox.runs.bundled``).

    Returns (model, cfg, tokenizer, summary): a Transformer with the saved float32 weights, its ModelConfig,
    the TextTokenizer and the model_summary.json dict ({} if that file is absent).
    Raises RunDirError naming the file: missing directory or file, unreadable JSON, an invalid config,
    a corrupt safetensors file, weights that do not match the config (missing / extra parameter, or a
    shape or dtype mismatch, with expected and found shapes), a tokenizer whose vocab_size differs from
    config.vocab_size, or weights whose SHA-256 is not the ``weights_sha256`` model_summary.json records
    (``dantinox.runs.weights_checksum``; checked unless ``verify`` is False or DANTINOX_VERIFY_WEIGHTS=0; a
    run directory without the entry loads unchecked).
    """
    run_dir = resolve_run_dir(run_dir)
    if not os.path.isdir(run_dir):
        what = ("is a file, not a directory" if os.path.exists(run_dir) else
                f"does not exist (bundled models, usable by name from any directory: {', '.join(bundled_names())})")
        raise RunDirError(f"run directory {run_dir!r} {what}")
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not os.path.isfile(os.path.join(run_dir, name)):
            unfinished = os.path.isdir(os.path.join(run_dir, "checkpoint"))
            hint = (" (it holds only a checkpoint: the training run did not finish; rerun the same "
                    "`dantinox train` command to resume it)") if unfinished else ""
            raise RunDirError(f"run directory {run_dir!r} has no {name}{hint}")
    summary_path = os.path.join(run_dir, SUMMARY_FILE)
    summary = _read_json(summary_path) if os.path.isfile(summary_path) else {}
    weights = os.path.join(run_dir, WEIGHTS_FILE)
    expected = summary.get(checksum.KEY) if isinstance(summary, dict) else None
    check = (checksum.WeightsCheck(weights, expected) if verify and isinstance(expected, str)
             and checksum.verify_enabled() else None)   # hashes beside the loading below
    cfg = _load_config(os.path.join(run_dir, CONFIG_FILE))
    tokenizer = _load_tokenizer(os.path.join(run_dir, TOKENIZER_FILE), cfg)
    try:
        model = _abstract_model(cfg, weights)
        _fill_params(model, weights)
    except RunDirError:
        damaged = check.mismatch() if check is not None else None
        if damaged:   # a damaged file is the cause: say that rather than what it broke
            raise RunDirError(damaged) from None
        raise
    damaged = check.mismatch() if check is not None else None
    if damaged:
        raise RunDirError(damaged)
    return model, cfg, tokenizer, summary


def read_summary(run_dir: str | os.PathLike) -> dict:
    """The model_summary.json dict of ``run_dir``. Raises RunDirError naming the file if absent/unreadable."""
    path = os.path.join(os.fspath(run_dir), SUMMARY_FILE)
    if not os.path.isfile(path):
        raise RunDirError(f"run directory {os.fspath(run_dir)!r} has no {SUMMARY_FILE}")
    return _read_json(path)


def _read_json(path: str) -> Any:
    """The JSON in ``path``; RunDirError naming it (missing, unreadable, not UTF-8, not JSON)."""
    try:
        return read_json(path, error=RunDirError)
    except InputFileNotFound as err:
        raise RunDirError(str(err)) from None


def _load_config(path: str) -> ModelConfig:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: expected a JSON object of ModelConfig fields")
    try:
        return ModelConfig.from_dict(data)
    except (ValueError, TypeError) as err:
        raise RunDirError(f"{path}: invalid model config ({err})") from err


def _load_tokenizer(path: str, cfg: ModelConfig) -> TextTokenizer:
    try:
        tokenizer = TextTokenizer.load(path)
    except (OSError, ValueError) as err:
        raise RunDirError(f"{path}: cannot load tokenizer ({err})") from err
    if tokenizer.vocab_size != cfg.vocab_size:
        raise RunDirError(f"{path}: tokenizer vocab_size {tokenizer.vocab_size} disagrees with "
                          f"{CONFIG_FILE} vocab_size {cfg.vocab_size}")
    return tokenizer


def _open_weights(path: str):
    """The open safetensors file (numpy framework); RunDirError naming it when it is not one."""
    try:
        return safetensors.safe_open(path, "np")
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise RunDirError(f"{path}: corrupted or unreadable safetensors file ({err})") from err


def _abstract_model(cfg: ModelConfig, path: str) -> nnx.Module:
    """The Transformer of ``cfg`` with the block modules the file's metadata names (none for a float run), as
    shapes only (``nnx.eval_shape``: no weights allocated, nothing random drawn; ``_fill_params`` sets them).
    RunDirError for a layout that does not fit the model."""
    with _open_weights(path) as f:
        text = (f.metadata() or {}).get(LAYOUT_KEY)
    try:
        layout = json.loads(text) if text else {}

        model = abstract_transformer(cfg)
        if layout:
            model = nnx.eval_shape(lambda: _with_layout(nnx.merge(*nnx.split(model)), layout))
        return model
    except (ValueError, TypeError) as err:
        raise RunDirError(f"{path}: block layout in the metadata does not fit the model ({err})") from err


def _with_layout(model: nnx.Module, layout: dict) -> nnx.Module:
    apply_block_layout(model, layout)
    return model


def _read_tensor(f, key: str, path: str) -> np.ndarray:
    """One parameter of the open file, checked: RunDirError naming it for a read error, non-finite float values
    or (uint8 blocks of ``<module>.parts.<i>.data``) a NaN / inf block scale."""
    try:
        array = f.get_tensor(key)
    except Exception as err:
        raise RunDirError(f"{path}: corrupted or unreadable safetensors file ({err})") from err
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise RunDirError(f"{path}: parameter {key} holds {bad} non-finite values (NaN or inf); "
                          f"the weights are corrupted")
    return array


def _fill_params(model: nnx.Module, path: str) -> None:
    """Set every parameter of ``model`` from the file, one tensor at a time (host memory: the largest tensor,
    not the file). RunDirError naming the parameter: missing, unexpected, shape or dtype mismatch, damaged."""
    formats = {}
    for module_path, node in nnx.iter_graph(model):
        for i, part in enumerate(getattr(node, "parts", None) or ()):
            formats[f"{'.'.join(map(str, module_path))}.parts.{i}.data"] = part.fmt
    filled = []
    with _open_weights(path) as f:
        keys = set(f.keys())
    for param_path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = ".".join(str(p) for p in param_path)
        want, dtype = tuple(var.get_value().shape), np.dtype(var.get_value().dtype)
        if key not in keys:
            raise RunDirError(f"{path}: missing parameter {key!r} (expected shape {want}); the weights do "
                              f"not match {CONFIG_FILE}")
        keys.discard(key)
        with _open_weights(path) as f:  # reopened per tensor: the mapped file pages go when it closes
            found = _read_tensor(f, key, path)
        if tuple(found.shape) != want or found.dtype != dtype:
            raise RunDirError(f"{path}: parameter {key!r} has shape {tuple(found.shape)} {found.dtype}; "
                              f"{CONFIG_FILE} expects {want} {dtype}")
        fmt = formats.get(key, "F32")
        if fmt != "F32" and found.dtype == np.uint8 and check_blocks(found, fmt):
            raise RunDirError(f"{path}: parameter {key} ({fmt}) has blocks whose scale is NaN or inf; the "
                              f"weights are corrupted")
        filled.append((param_path, var.replace(jnp.asarray(found))))
        del found
    if keys:
        raise RunDirError(f"{path}: unexpected parameter(s) {sorted(keys)[:5]} not in the model built from "
                          f"{CONFIG_FILE}")
    nnx.update(model, nnx.from_flat_state(filled))
