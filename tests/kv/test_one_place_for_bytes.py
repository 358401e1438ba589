"""Cache bytes are computed in one place: the layer specs of dantinox.kv (dantinox/kv/spec.py and sizes.py).

An AST check over every module outside dantinox/kv/: no function multiplies a cache size (KV heads, head size,
latent or RoPE width, key group, sink tokens, the cache dtype) into a byte count. A function is flagged when
it multiplies such a size (read as ``cfg.kv_heads``, or through a local name assigned from one) and either is
named for bytes or touches an itemsize / nbytes / *_BYTES constant. The checker is tested on planted formulas
(one of them the inline per-channel formula ``dantinox budget`` used to carry), so it cannot pass vacuously.
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "dantinox"
SIZES = {"kv_heads", "head_size", "kv_latent_dim", "rope_head_dim", "key_group", "kv_key_group", "sink_slots",
         "kv_sink_tokens", "jnp_cache_dtype", "cache_dtype"}
BYTE_NAMES = {"itemsize", "nbytes", "SCALE_BYTES", "SINK_BYTES", "RESIDUAL_BYTES"}


def _reads_size(node, local_sizes) -> bool:
    return any((isinstance(x, ast.Attribute) and x.attr in SIZES) or (isinstance(x, ast.Name) and x.id in local_sizes)
               for x in ast.walk(node))


def byte_formulas(source: str) -> list[str]:
    """Functions of ``source`` that compute cache bytes from cache sizes (module docstring)."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local_sizes = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _reads_size(node.value, set()):
                for target in node.targets:
                    local_sizes |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        names = ({n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
                 | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)})
        multiplies = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and _reads_size(n, local_sizes)
                         for n in ast.walk(fn))
        if multiplies and ("bytes" in fn.name.lower() or names & BYTE_NAMES):
            found.append(fn.name)
    return found


PLANTED = '''
def token_bytes(cfg, dtype):
    K, D, G = cfg.kv_heads, cfg.head_size, cfg.key_group
    return cfg.num_blocks * (2 * K * D + 4 * K + 4 * K * D / G)

def dual(cfg, n):
    item = np.dtype(cfg.jnp_cache_dtype).itemsize
    return cfg.num_blocks * 2 * cfg.kv_heads * n * cfg.head_size * item

def qkv_width(cfg):
    return (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_size
'''


def test_the_checker_finds_planted_formulas():
    assert byte_formulas(PLANTED) == ["token_bytes", "dual"]   # a projection width is not a byte count


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] != "kv"),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_cache_byte_formula_outside_kv(path):
    assert byte_formulas(path.read_text()) == [], f"{path.relative_to(PKG)} computes cache bytes: ask dantinox.kv.sizes"
