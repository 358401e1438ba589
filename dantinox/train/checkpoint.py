"""Resumable training state on disk, written so that a crash never leaves a half-written file.

Layout of ``out_dir/checkpoint/``:
  ``state-<step>.safetensors``  every array of the training state (model parameters, optimizer state), one
                                entry per pytree leaf, keyed by its path joined with "/" (for example
                                ``params/blocks/0/attn/qkv/kernel/value``).
  ``meta.json``                 step, numpy RNG state, elapsed time, tokens seen, the model config, the
                                trainer options, the tokenizer, the name of the arrays file and its SHA-256
                                (``arrays_sha256``: a damaged arrays file is refused on resume, naming it; a
                                checkpoint written without the entry resumes unchecked).

Commit protocol: the arrays file for step N is written first (under a new name), then ``meta.json`` is
replaced so that it points to it, and only then are older arrays files deleted. ``meta.json`` is the single
commit point, so a crash at any moment leaves the previous checkpoint whole. Every file is written by
:func:`atomic_write_bytes`: a temporary file in the same directory, flush, fsync, ``os.replace``.

Restoring matches the tree structure of a freshly built state (the ``template``): every leaf path must be
present with the same shape and dtype, and no extra entry may remain.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from ..parallel.distributed import to_host
from ..runs.files import atomic_write_bytes, atomic_write_json
from ..runs.weights_checksum import file_sha256, sha256_hex, verify_enabled

META_FILE = "meta.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing pieces, unreadable, or does not match the state it is restored into."""


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_key(path) -> str:
    """A pytree key path as "a/b/0/c" (dict keys, attribute names and sequence indices joined by "/")."""
    return "/".join(_key_name(entry) for entry in path)


def flatten_tree(tree) -> dict[str, np.ndarray]:
    """Every leaf of ``tree`` as a host numpy array, keyed by :func:`path_key`.

    Raises CheckpointError if two leaves map to the same key.
    """
    flat: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = path_key(path)
        if key in flat:
            raise CheckpointError(f"two leaves share the checkpoint key {key!r}")
        flat[key] = to_host(leaf)  # whole array, gathered from every device and process
    return flat


def unflatten_like(template, arrays: dict[str, np.ndarray], source: str = "checkpoint"):
    """Rebuild ``template``'s tree with the arrays of ``arrays`` (as jax arrays of the template's dtypes).

    Raises CheckpointError naming ``source`` and the key for a missing key, an extra key, or a shape or
    dtype that differs from the template's.
    """
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves, seen = [], set()
    for path, ref in leaves_with_path:
        key = path_key(path)
        if key not in arrays:
            raise CheckpointError(f"{source}: missing array {key!r} (expected shape {tuple(ref.shape)})")
        value = arrays[key]
        if tuple(value.shape) != tuple(ref.shape) or np.dtype(value.dtype) != np.dtype(ref.dtype):
            raise CheckpointError(f"{source}: array {key!r} has shape {tuple(value.shape)} {value.dtype}; "
                                  f"expected {tuple(ref.shape)} {np.dtype(ref.dtype)}")
        leaves.append(jnp.asarray(value))
        seen.add(key)
    extra = sorted(set(arrays) - seen)
    if extra:
        raise CheckpointError(f"{source}: unexpected arrays {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return jax.tree_util.tree_unflatten(treedef, leaves)


def save_checkpoint(ckpt_dir: str | os.PathLike, state, meta: dict) -> str:
    """Write a checkpoint of ``state`` (any pytree of arrays) and ``meta`` (JSON-serialisable, with "step").

    Returns the path of the arrays file. Older arrays files are removed once ``meta.json`` points to the
    new one. Raises OSError from the file system, CheckpointError if meta has no integer "step".
    """
    if not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint meta needs an integer 'step'; got {meta.get('step')!r}")
    ckpt_dir = os.fspath(ckpt_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    name = f"state-{meta['step']:08d}.safetensors"
    data = safetensors.numpy.save(flatten_tree(state))
    atomic_write_bytes(os.path.join(ckpt_dir, name), data)
    atomic_write_json(os.path.join(ckpt_dir, META_FILE), {**meta, "arrays": name, "format": FORMAT_VERSION,
                                                          "arrays_sha256": sha256_hex(data)})
    for old in os.listdir(ckpt_dir):
        if old.startswith("state-") and old.endswith(".safetensors") and old != name:
            os.remove(os.path.join(ckpt_dir, old))
    return os.path.join(ckpt_dir, name)


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> dict | None:
    """The committed ``meta.json`` of ``ckpt_dir``, or None when there is no checkpoint.

    Raises CheckpointError if meta.json is unreadable or names an arrays file that does not exist.
    """
    path = os.path.join(os.fspath(ckpt_dir), META_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({err})") from err
    arrays = os.path.join(os.fspath(ckpt_dir), str(meta.get("arrays")))
    if not os.path.isfile(arrays):
        raise CheckpointError(f"{path} names the arrays file {meta.get('arrays')!r}, which does not exist")
    return meta


def load_checkpoint(ckpt_dir: str | os.PathLike, template) -> tuple[Any, dict] | None:
    """Restore (state, meta) from ``ckpt_dir`` into the structure of ``template``; None if no checkpoint.

    Raises CheckpointError naming the file for an unreadable or damaged arrays file (its SHA-256 is not the
    ``arrays_sha256`` meta.json records) or a tree that does not match.
    """
    meta = read_checkpoint_meta(ckpt_dir)
    if meta is None:
        return None
    path = os.path.join(os.fspath(ckpt_dir), meta["arrays"])
    expected = meta.get("arrays_sha256")
    found = file_sha256(path) if isinstance(expected, str) and verify_enabled() else expected
    if found != expected:
        raise CheckpointError(f"{path}: damaged: its sha256 is {found}, not the {expected} recorded in "
                              f"{META_FILE} when the checkpoint was saved; restore it, or start the run over")
    try:
        arrays = safetensors.numpy.load_file(path)
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: cannot read safetensors file ({err})") from err
    return unflatten_like(template, arrays, source=path), meta
