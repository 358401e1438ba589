"""The one ``generate()`` call for both paradigms: an autoregressive model goes to the static-cache decode loop
(``dantinox.generation.decode``), a ``paradigm="diffusion"`` model to masked diffusion
(``dantinox.generation.diffusion``). The options of one paradigm are refused on the other."""

from __future__ import annotations

import numpy as np

from .decode import _prepare, _run, place_on_mesh
from .diffusion import diffusion_generate

DIFFUSION_OPTIONS = ("block_size", "steps_per_block", "threshold", "refresh")


def _check_paradigm_options(cfg, top_k, top_p, eos_id, diffusion: dict) -> None:
    """Raise ValueError for AR-only options on a diffusion model and diffusion options on an AR model."""
    if cfg.paradigm == "diffusion":
        ar_only = {"top_k": (top_k, 0), "top_p": (top_p, 1.0), "eos_id": (eos_id, None)}
        bad = [f"{k}={v!r}" for k, (v, default) in ar_only.items() if v is not None and v != default]
        if bad:
            raise ValueError(f"{', '.join(bad)} not allowed for a paradigm='diffusion' model: top_k, top_p and "
                             f"eos_id apply to autoregressive models only; diffusion takes {DIFFUSION_OPTIONS}")
        return
    given = [f"{k}={v!r}" for k, v in diffusion.items() if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} not allowed for a paradigm={cfg.paradigm!r} model: "
                         f"{DIFFUSION_OPTIONS} apply to paradigm='diffusion' models only")


def generate(model, prompt_ids, max_new_tokens: int = 64, *, use_cache: bool = True, temperature=0.0,
             top_k=0, top_p=1.0, seed: int = 0, eos_id=None, block_size: int | None = None,
             steps_per_block: int | None = None, threshold: float | None = None,
             refresh: str | None = None, mesh=None) -> np.ndarray:
    """Generate up to max_new_tokens for one prompt or a batch of prompts of different lengths.

    A model with ``paradigm="diffusion"`` is dispatched to :func:`dantinox.generation.diffusion.diffusion_generate`
    with gen_len = max_new_tokens, block_size (default min(32, max_new_tokens)), steps_per_block (default
    block_size), threshold and refresh (default "block"); top_k, top_p and eos_id are then not allowed.

    Args:
      model: a dantinox Transformer.
      prompt_ids: one prompt (sequence of token ids) or a batch (list of sequences, or [B, T] array).
      max_new_tokens: new tokens per row (N); prompt_length + N <= max_context for every row.
      use_cache: False recomputes the whole sequence for every token (same greedy tokens, much slower).
      temperature: float or one per row; 0 (or <= 1e-5) is greedy (argmax, ties to the lowest id).
      top_k: int or one per row; 0 = off.   top_p: float in (0, 1] or one per row; 1.0 = off.
      seed: integer in [0, 2**32) for the sampling keys.
      eos_id: a token id or a list of up to MAX_EOS_IDS ids; a row stops after producing any of them.
      mesh: a ``dantinox.make_mesh`` mesh: the parameters are sharded over it (in place, once) and the
        program runs on it (``docs/how-to/multi-device.md``). A model already sharded runs on its mesh anyway.
    Returns:
      int32 array of new tokens, [N] for a single prompt or [B, N] for a batch; after a row's EOS the
      remaining positions hold the first eos_id.
    Raises:
      ValueError: empty prompt or batch, ids outside the vocabulary, bad sampling settings, bad seed/eos_id,
        AR-only options (top_k, top_p, eos_id) on a diffusion model or diffusion options on an AR model.
      CapacityError: prompt longer than max_context, or prompt_length + max_new_tokens > max_context.
      MeshError: n_heads or mlp_hidden not divisible by the mesh's model axis.
    """
    diffusion = dict(block_size=block_size, steps_per_block=steps_per_block, threshold=threshold,
                     refresh=refresh)
    _check_paradigm_options(model.cfg, top_k, top_p, eos_id, diffusion)
    place_on_mesh(model, mesh)
    if model.cfg.paradigm == "diffusion":
        block = min(32, max_new_tokens) if block_size is None and isinstance(max_new_tokens, int) else block_size
        return diffusion_generate(model, prompt_ids, max_new_tokens, block, steps_per_block, threshold=threshold,
                                  temperature=temperature, use_cache=use_cache, refresh=refresh or "block",
                                  seed=seed)
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    tokens = _run(req, model, use_cache).tokens
    return tokens[0] if req.single else tokens
