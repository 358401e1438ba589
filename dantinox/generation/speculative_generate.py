"""Host side of speculative decoding: check the request, prefill, run the compiled speculative loop, report
the acceptance.

``speculative_generate(model, prompt_ids, max_new_tokens, spec_tokens=k, ngram_max=n, ...)`` takes the same
arguments as ``decode.generate_result`` and returns the same GenerationResult (greedy: the same tokens) with a
SpecStats. Errors: ValueError naming ``spec_tokens`` / ``ngram_max`` / ``ngram_min`` out of bounds, or a
diffusion model; CapacityError as plain generation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from ..parallel.distributed import to_host
from ..parallel.mesh import mesh_of, mesh_scope
from .decode import _finish, _prepare, place_on_mesh, prefill, split_model
from .speculative import MAX_SPEC_TOKENS, spec_state, speculative_decode


class SpecStats(NamedTuple):
    """Per request: proposed and accepted proposal counts ([B] ints), verify calls and loop iterations.
    acceptance_rate: accepted / proposed over the batch (0.0 when nothing was proposed); mean accepted length:
    tokens emitted per verify call, accepted + 1 (the target's own token)."""

    proposed: list
    accepted: list
    verify_calls: int
    iterations: int

    @property
    def acceptance_rate(self) -> float:
        total = sum(self.proposed)
        return float(sum(self.accepted) / total) if total else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return float(sum(self.accepted) / (self.verify_calls * len(self.proposed)) + 1) if self.verify_calls else 0.0


def check_spec_settings(spec_tokens, ngram_max, ngram_min) -> None:
    """ValueError naming the setting: spec_tokens in 1..MAX_SPEC_TOKENS, 1 <= ngram_min <= ngram_max <= 16."""
    for name, value in (("spec_tokens", spec_tokens), ("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: an integer >= 1")
    if spec_tokens > MAX_SPEC_TOKENS:
        raise ValueError(f"spec_tokens={spec_tokens} is not allowed: at most {MAX_SPEC_TOKENS} proposed tokens")
    if ngram_max > 16 or ngram_min > ngram_max:
        raise ValueError(f"ngram_min={ngram_min}, ngram_max={ngram_max} is not allowed: 1 <= ngram_min <= "
                         "ngram_max <= 16")


def speculative_generate(model, prompt_ids, max_new_tokens: int = 64, *, spec_tokens: int = 4, ngram_max: int = 4,
                         ngram_min: int = 1, temperature=0.0, top_k=0, top_p=1.0, seed: int = 0, eos_id=None,
                         mesh=None):
    """Generate with n-gram speculation. Returns (GenerationResult, SpecStats); see the module docstring."""
    check_spec_settings(spec_tokens, ngram_max, ngram_min)
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    place_on_mesh(model, mesh)
    graphdef, params = split_model(model)
    stop = jnp.int32(req.max_new_tokens)
    with mesh_scope(mesh_of(params)):
        state = prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill)
        state = spec_state(state, jnp.asarray(req.ids))
        state = speculative_decode(graphdef, params, state, stop, req.key, req.sampling, req.eos_id, req.fill,
                                   k=int(spec_tokens), ngram_max=int(ngram_max), ngram_min=int(ngram_min))
    stats = SpecStats([int(x) for x in np.asarray(state.proposed)], [int(x) for x in np.asarray(state.accepted)],
                      int(state.verify_calls), int(state.iteration))
    return _finish(to_host(state.out), req), stats
