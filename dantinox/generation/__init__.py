"""The decode path: ``generate()`` in paradigm.py picks decode.py (autoregressive) or diffusion.py.

  paradigm.py    generate(): one call for both paradigms
  decode.py      prefill, the compiled decode loop over the static cache, streaming, the uncached path
  diffusion.py   masked diffusion (LLaDA) with a DualCache (Fast-dLLM)
  prompts.py     length buckets, padded prompt batches, the capacity check, stop ids
  sampling.py    greedy, temperature, top-k, top-p; the token mask of structured outputs
  grammar.py     structured outputs: JSON schema / regex / grammar / choice constraints and the per-row
                 token matcher (llguidance), host side
  constrained_decode.py  constrained decoding: a host-stepped loop over one compiled masked step
  generator.py   Generator: text in, text out, from a run directory
  sessions.py    a Generator's session: the last one-prompt call's static cache kept, continued, saved, loaded
"""

from .decode import GenerationResult, generate_result, stream_tokens
from .diffusion import DiffusionResult, DualCache, diffusion_generate, diffusion_generate_result, init_dual_cache
from .generator import Generator
from .paradigm import generate
from .sampling import SamplingParams, make_sampling_params, sample_next

__all__ = ["DiffusionResult", "DualCache", "GenerationResult", "Generator", "SamplingParams",
           "diffusion_generate", "diffusion_generate_result", "generate", "generate_result", "init_dual_cache",
           "make_sampling_params", "sample_next", "stream_tokens"]
