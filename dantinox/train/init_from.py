"""Initialise a model from another run's weights (``dantinox train --init_from RUN_DIR``).

Used to adapt an autoregressive model to masked diffusion, as in Gong et al. 2024, "Scaling Diffusion
Language Models via Adaptation from Autoregressive Models" (DiffuLLaMA), and Dream 7B (Ye et al. 2025),
which both start the diffusion model from an AR checkpoint of the same backbone. The diffusion model has the
AR model's parameters and one more vocabulary row, ``<mask>``:

  - every parameter whose path and shape match is copied;
  - a vocabulary parameter (``embed.embedding`` [V, E], ``lm_head.kernel`` [E, V]) that is larger only along
    its vocabulary axis keeps the source rows and gets the new ones (``<mask>``) as the mean of the source
    rows: the MASK input starts as the average token, and its logit (never a target) as the average logit;
  - anything else (a missing or extra parameter, another shape: a different dim, block count or attention
    kind) raises :class:`InitFromError` naming the parameter and both shapes.

The tokenizers must agree: the new one must be the source's (same kind, merges and ids) with tokens only
appended after the source's last id.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..runs.run_dir import load_run, param_arrays
from ..runs.tokenizer import TextTokenizer

VOCAB_AXES = {"embed.embedding": 0, "lm_head.kernel": 1}  # parameter -> its vocabulary axis


class InitFromError(ValueError):
    """The source run cannot initialise this model: another shape, parameter set or tokenizer."""


def check_tokenizer_extends(source: TextTokenizer, target: TextTokenizer, where: str = "") -> None:
    """Raise InitFromError unless ``target`` is ``source`` with tokens appended (same ids below V_source).

    Compares the tokenizer kind, the model section (vocabulary and BPE merges), the pre-tokenizer, decoder
    and normaliser of the two tokenizer.json files, and the ids of the source's added tokens.
    """
    prefix = f"{where}: " if where else ""
    if source.kind != target.kind:
        raise InitFromError(f"{prefix}tokenizer kind differs: the source run has {source.kind!r}, the new model "
                            f"{target.kind!r}")
    a, b = json.loads(source.to_json()), json.loads(target.to_json())
    for section in ("model", "pre_tokenizer", "decoder", "normalizer"):
        if a.get(section) != b.get(section):
            raise InitFromError(f"{prefix}tokenizers differ in their {section!r} section (vocabulary, merges or "
                                f"text processing); the new model must use the source run's tokenizer")
    for token in a.get("added_tokens") or []:
        if target.hf.token_to_id(token["content"]) != token["id"]:
            raise InitFromError(f"{prefix}added token {token['content']!r} has id {token['id']} in the source "
                                f"run but {target.hf.token_to_id(token['content'])} in the new tokenizer")
    if target.vocab_size < source.vocab_size:
        raise InitFromError(f"{prefix}the new tokenizer has {target.vocab_size} tokens, fewer than the source "
                            f"run's {source.vocab_size}")


def adapt_arrays(source: dict[str, np.ndarray], target_shapes: dict[str, tuple],
                 where: str = "") -> tuple[dict[str, np.ndarray], list[str]]:
    """Map source arrays onto the target's parameter shapes (see the module docstring).

    source: {path: float32 array}; target_shapes: {path: shape} of the model to initialise.
    Returns ({path: array of the target shape}, [paths grown along the vocabulary axis]).
    Raises InitFromError naming the first parameter that is missing, extra or of another shape.
    """
    prefix = f"{where}: " if where else ""
    missing = sorted(set(target_shapes) - set(source))
    extra = sorted(set(source) - set(target_shapes))
    if missing or extra:
        raise InitFromError(f"{prefix}parameters differ: the new model has {missing[:5]} that the source run "
                            f"lacks, the source run has {extra[:5]} that the new model lacks (another block "
                            f"count, attention kind or head)")
    out, grown = {}, []
    for path, want in target_shapes.items():
        have = tuple(source[path].shape)
        want = tuple(want)
        if have == want:
            out[path] = source[path]
        elif _grows_vocab(path, have, want):
            axis = VOCAB_AXES[path]
            src = source[path]
            new = want[axis] - have[axis]
            rows = np.repeat(src.mean(axis=axis, keepdims=True), new, axis=axis)
            out[path] = np.concatenate([src, rows], axis=axis).astype(np.float32)
            grown.append(path)
        else:
            raise InitFromError(f"{prefix}parameter {path!r} has shape {have} in the source run but {want} in "
                                f"the new model (another dim, head or MLP size); only the vocabulary axis of "
                                f"{sorted(VOCAB_AXES)} may grow")
    return out, grown


def _grows_vocab(path: str, have: tuple, want: tuple) -> bool:
    if path not in VOCAB_AXES or len(have) != len(want):
        return False
    axis = VOCAB_AXES[path]
    same_elsewhere = all(h == w for i, (h, w) in enumerate(zip(have, want)) if i != axis)
    return same_elsewhere and want[axis] > have[axis]


def init_from_run(model: nnx.Module, tokenizer: TextTokenizer, run_dir: str | os.PathLike) -> list[str]:
    """Overwrite ``model``'s parameters with those of the run at ``run_dir`` (in place).

    tokenizer: the new model's tokenizer; it must extend the run's (check_tokenizer_extends).
    Returns the parameters grown along the vocabulary axis. Raises RunDirError (unreadable run directory)
    or InitFromError (tokenizer or parameter mismatch, naming the parameter and both shapes).
    """
    run_dir = os.fspath(run_dir)
    source_model, _, source_tokenizer, _ = load_run(run_dir)
    check_tokenizer_extends(source_tokenizer, tokenizer, f"--init_from {run_dir}")
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    shapes = {".".join(str(p) for p in path): tuple(var.get_value().shape) for path, var in flat}
    arrays, grown = adapt_arrays(param_arrays(source_model), shapes, f"--init_from {run_dir}")
    nnx.update(model, nnx.from_flat_state(
        [(path, var.replace(jnp.asarray(arrays[".".join(str(p) for p in path)]))) for path, var in flat]))
    return grown


def load_source_tokenizer(run_dir: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of the run at ``run_dir`` (RunDirError if the directory or file is missing/invalid)."""
    return load_run(run_dir)[2]
