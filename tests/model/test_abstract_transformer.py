"""``abstract_transformer``: one block traced and copied gives the same model as tracing the whole constructor
(``nnx.eval_shape``): the same GraphDef (the program store keys programs by it) and the same parameter shapes
and dtypes, for every attention kind, tied and untied heads, and the int8 cache."""

import jax
import pytest
from flax import nnx

from dantinox.config import ModelConfig
from dantinox.model.transformer import Transformer, abstract_transformer

CONFIGS = {
    "tiny": ModelConfig.from_preset("tiny"),
    "tiny-mla": ModelConfig.from_preset("tiny-mla"),
    "gqa-untied-int8": ModelConfig.from_preset("dante").replace(tie_embeddings=False, cache_dtype="int8"),
    "mqa-3-blocks": ModelConfig.from_preset("tiny").replace(attention="mqa", kv_heads=1, num_blocks=3),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_copied_blocks_make_the_traced_model(name):
    cfg = CONFIGS[name]
    graph, state = nnx.split(abstract_transformer(cfg))
    want_graph, want_state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    assert graph == want_graph
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert shapes(state) == shapes(want_state)
    assert len(abstract_transformer(cfg).blocks) == cfg.num_blocks


def test_the_copies_are_separate_modules():
    """Each block is its own module (filling one block's weights leaves the others alone)."""
    model = abstract_transformer(CONFIGS["mqa-3-blocks"])
    assert len({id(block) for block in model.blocks}) == 3
    assert len({id(block.attn) for block in model.blocks}) == 3
