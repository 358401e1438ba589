"""A float32 model asks for float32 dots on every backend (``transformer.float32_matmuls``): on a GPU, JAX's
default precision lets cuBLAS round float32 inputs to TF32, and the bundled model's cached-vs-uncached gap grew
from 1.3e-5 to 6.7e-3 on an H200 (``dantinox verify`` failed there). The CPU ignores the setting, so the check
is on the lowered program: every dot of a float32 model carries precision HIGHEST, a bfloat16 model's none."""

import re

import jax
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import dantinox as dx

DOT = re.compile(r"stablehlo\.dot_general[^\n]*")


def _dots(cfg, use_cache: bool) -> list[str]:
    model = dx.build_model(cfg)
    graph, params = nnx.split(model)
    cache = dx.init_cache(cfg, 1) if use_cache else None

    def forward(params, ids, cache):
        return nnx.merge(graph, params)(ids, use_cache=use_cache, kv_caches=cache, cache_index=0)[0]

    text = jax.jit(forward).lower(params, np.zeros((1, 5), np.int32), cache).as_text()
    return DOT.findall(text)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_every_dot_of_a_float32_model_is_at_full_precision(attention, use_cache):
    cfg = dx.ModelConfig.from_preset("tiny-mla") if attention == "mla" else tiny_config(tie_embeddings=True)
    dots = _dots(cfg, use_cache)
    assert len(dots) >= 8   # q, k, v, o, three MLP matrices per layer, the head, the attention products
    lax_precision = [d for d in dots if "HIGHEST" not in d]
    assert not lax_precision, lax_precision[:2]


def test_a_bfloat16_model_keeps_the_default_precision():
    dots = _dots(tiny_config(compute_dtype="bfloat16"), use_cache=True)
    assert dots and not any("HIGHEST" in d for d in dots)
