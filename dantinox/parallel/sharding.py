"""How every parameter and cache array is laid out on a (data, model) mesh (see ``dantinox.parallel.mesh``).

Logical axes. Each parameter dimension gets a logical name, and LOGICAL_RULES maps names to mesh axes:

  parameter (path)                 shape               logical axes         on the mesh
  embed.embedding                  [V, E]              (vocab, embed)       V over model
  lm_head.kernel                   [E, V]              (embed, vocab)       V over model
  attn.qkv.kernel  (MHA/GQA/MQA)   [E, (H + 2K) D]     (embed, heads)       columns over model
  attn.out.kernel                  [H D, E]            (heads, embed)       rows over model
  attn.q_up.kernel (MLA)           [Q or E, H (D + R)] (None, heads)        columns over model
  attn.w_uk, attn.w_uv (MLA)       [H, D, C], [H, C, D](heads, None, None)  H over model
  attn.down.kernel (MLA)           [E, Q + C + R]      replicated           (the latent is per token, not per head)
  mlp.gate_up.kernel               [E, 2F]             (embed, mlp)         columns over model
  mlp.down.kernel                  [F, E]              (mlp, embed)         rows over model
  ....parts.<i>.data (blocks)      [N, row bytes]      rows over model      a block part's output channels, whole
                                                                            rows of blocks (where N divides)
  every RMSNorm scale, anything else                   replicated

This is the Megatron layout (Shoeybi et al. 2019, section 3): the matmul into a sub-layer is split by
columns, the one out of it by rows, and the row-parallel product ends in one all-reduce over ``model``.
Two fused projections are stored [q | k | v] and [gate | up]; their columns are split contiguously, so
device i does not hold exactly its own heads' q, k and v (or gate and up): XLA reshards the small activations
after the split (measured in benchmarks/bench_mesh.py). With ``fsdp=True`` the ``embed`` dimension of
every matrix is also split over ``data`` (ZeRO-3 style parameter sharding for training; Rajbhandari et al.
2020, "ZeRO", section 5), and XLA all-gathers each matrix where it is used.

Why path rules rather than ``nnx.with_partitioning`` on each module: the modules (model/attention.py,
model/mla.py, model/layers.py, model/transformer.py) stay untouched, a parameter added by another architecture
is simply replicated (and reported by :func:`unmatched_params`) instead of failing, and the whole layout reads
in one table.

Divisibility. Query heads (n_heads) and the MLP width (mlp_hidden) must divide by the ``model`` size, or
:class:`MeshError` names the field and the axis. The vocabulary is split only where V divides by it
(replicated otherwise; the budget counts it). The static cache [B, K, S, D] is split over KV heads on
``model`` where K divides by its size and replicated over ``model`` otherwise (MQA, or model > K); MLA's
latent cache [B, S, C] is replicated over ``model``. Rows (B) go over ``data`` where B divides by its size.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from .mesh import Mesh, MeshError, ambient_mesh_shape, mesh_shape

LOGICAL_RULES = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model",
                 "embed": None}
FSDP_RULES = {**LOGICAL_RULES, "embed": "data"}

# Path suffix -> logical axis names per dimension (None: not split).
PARAM_AXES = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("attn", "qkv", "kernel"): ("embed", "heads"),
    ("attn", "out", "kernel"): ("heads", "embed"),
    ("attn", "q_up", "kernel"): (None, "heads"),
    ("attn", "w_uk"): ("heads", None, None),
    ("attn", "w_uv"): ("heads", None, None),
    ("mlp", "gate_up", "kernel"): ("embed", "mlp"),
    ("mlp", "down", "kernel"): ("mlp", "embed"),
}
REQUIRED = {"heads": "n_heads", "mlp": "mlp_hidden"}  # logical axes that must divide (the config field named)


def logical_axes(path: tuple, ndim: int) -> tuple:
    """Logical axis names of a parameter from its module path, e.g. ('blocks', 0, 'attn', 'qkv', 'kernel')
    -> ('embed', 'heads'); a tuple of None (replicated) for paths without a rule."""
    for suffix, axes in PARAM_AXES.items():
        if tuple(path[-len(suffix):]) == suffix and len(axes) == ndim:
            return axes
    return (None,) * ndim


def check_model_fits(cfg: ModelConfig, mesh: Mesh | dict | None) -> None:
    """Raise MeshError if a dimension that tensor parallelism must split does not divide by the ``model`` axis:
    n_heads (query heads) or mlp_hidden. The message names the config field, its value and the axis.
    mesh: a Mesh or its sizes {"data": D, "model": M}."""
    M = (mesh if isinstance(mesh, dict) else mesh_shape(mesh))["model"]
    for field, value in (("n_heads", cfg.n_heads), ("mlp_hidden", cfg.mlp_hidden)):
        if value % M:
            raise MeshError(f"{field}={value} is not divisible by mesh axis model={M}: tensor parallelism "
                            f"splits {field} over 'model'; use a model size that divides {value}")


def param_spec(path: tuple, shape: tuple, mesh: Mesh | dict | None, fsdp: bool = False) -> P:
    """PartitionSpec of one parameter: its logical axes mapped through LOGICAL_RULES (FSDP_RULES with fsdp),
    keeping a dimension unsplit where its size does not divide by the axis (only allowed for vocab and embed;
    :func:`check_model_fits` rejects the others first). mesh: a Mesh, or its sizes {"data": D, "model": M}
    (to plan for devices this process does not have)."""
    sizes = mesh if isinstance(mesh, dict) else mesh_shape(mesh)
    if len(path) >= 3 and path[-3] == "parts" and path[-1] == "data" and len(shape) == 2:
        rows = sizes["model"] > 1 and shape[0] % sizes["model"] == 0   # a block part: whole rows over model
        return P("model" if rows else None, None)
    rules = FSDP_RULES if fsdp else LOGICAL_RULES
    spec = []
    for dim, name in zip(shape, logical_axes(path, len(shape))):
        axis = rules.get(name) if name else None
        spec.append(axis if axis and sizes[axis] > 1 and dim % sizes[axis] == 0 else None)
    return P(*spec)


def param_shardings(model: nnx.Module, mesh: Mesh, fsdp: bool = False) -> dict:
    """{path: NamedSharding} for every nnx.Param of ``model`` (see the table in the module docstring)."""
    return {path: NamedSharding(mesh, param_spec(path, node.get_value().shape, mesh, fsdp))
            for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)}


def unmatched_params(model: nnx.Module) -> list[tuple]:
    """Paths of matrices (ndim >= 2) that no rule covers, so they stay replicated (for reports and tests)."""
    return [path for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param) and node.get_value().ndim >= 2
            and all(a is None for a in logical_axes(path, node.get_value().ndim))
            and not tuple(path[-3:]) == ("attn", "down", "kernel")]


def shard_model(model: nnx.Module, mesh: Mesh | None, fsdp: bool = False) -> nnx.Module:
    """Place every parameter of ``model`` on ``mesh`` (in place; returns the model). None is a no-op.

    Raises MeshError (see :func:`check_model_fits`). Block weights (a GGUF import or --quantize int4 / q8_0:
    ``dantinox.quant.block_linear``, each part's data [N, row bytes]) are split by whole rows (output channels)
    over ``model`` where N divides by its size, replicated otherwise; the block kernel then runs per device
    inside a shard_map (``dantinox.quant.block_kernel``). Later calls to generate, verify or the trainer then run
    on the mesh (they read it from the parameters, ``dantinox.parallel.mesh.mesh_of``).
    """
    if mesh is None:
        return model
    check_model_fits(model.cfg, mesh)
    shardings = param_shardings(model, mesh, fsdp)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            node.set_value(jax.device_put(node.get_value(), shardings[path]))
    return model


def cache_specs(cfg: ModelConfig, batch_size: int, sizes: dict[str, int]) -> tuple[P, P]:
    """PartitionSpecs of one layer's two cache arrays on a mesh of ``sizes`` ({"data": D, "model": M}):
    k, v [B, K, S, D] -> (data?, model?, None, None); MLA c_kv [B, S, C], k_rope [B, S, R] ->
    (data?, None, None). "data" where B divides by D; "model" where K divides by M (else replicated)."""
    rows = "data" if sizes["data"] > 1 and batch_size % sizes["data"] == 0 else None
    if cfg.attention == "mla":
        return P(rows, None, None), P(rows, None, None)
    heads = "model" if sizes["model"] > 1 and cfg.kv_heads % sizes["model"] == 0 else None
    return P(rows, heads, None, None), P(rows, heads, None, None)


def cache_layout(cfg: ModelConfig, mesh: Mesh | dict | None) -> str:
    """One line saying how the static cache is laid out on ``mesh`` (a Mesh or its sizes; for the budget)."""
    M = (mesh if isinstance(mesh, dict) else mesh_shape(mesh))["model"]
    if M == 1:
        return "cache not split over model"
    if cfg.attention == "mla":
        return f"latent cache replicated over model={M} (it has no heads to split)"
    if cfg.kv_heads % M:
        return f"cache replicated over model={M}: kv_heads={cfg.kv_heads} is not divisible by {M}"
    return f"cache split over KV heads: {cfg.kv_heads // M} of kv_heads={cfg.kv_heads} per device"


def shard_cache(cache, cfg: ModelConfig, mesh: Mesh | None):
    """Place a static cache (``init_cache(cfg, B)``) on ``mesh`` as :func:`cache_specs` says; None: no-op."""
    if mesh is None:
        return cache
    batch = jax.tree_util.tree_leaves(cache)[0].shape[0]
    specs = cache_specs(cfg, batch, mesh_shape(mesh))
    return tuple(type(layer)(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(layer, _per_field(
        specs, layer)))) for layer in cache)


def constrain_cache(cache, cfg: ModelConfig):
    """Inside a compiled function: pin the cache to :func:`cache_specs` on the ambient mesh (the one
    ``dantinox.parallel.mesh.mesh_scope`` set), so prefill, every decode step and the loop carry keep one layout and
    nothing gathers the cache onto one device. Without an ambient (data, model) mesh it returns the cache."""
    sizes = ambient_mesh_shape()
    if sizes is None or cache is None:
        return cache
    batch = jax.tree_util.tree_leaves(cache)[0].shape[0]
    specs = cache_specs(cfg, batch, sizes)
    return tuple(type(layer)(*(jax.lax.with_sharding_constraint(a, s) for a, s in zip(layer, _per_field(
        specs, layer)))) for layer in cache)


def _per_field(specs: tuple[P, P], layer) -> tuple[P, ...]:
    """One spec per field of a layer cache: (k, v) or MLA (c_kv, k_rope) take the two specs; the int8 layouts
    (QuantLayerKV, QuantLatentKV) add their scales, which have the same rank and split as their values; every
    field of the per-channel layout (ChannelQuantLayerKV, seven) is [B, K, ., .] and takes the keys' spec."""
    if len(layer) % len(specs):
        return (specs[0],) * len(layer)
    return specs * (len(layer) // len(specs))


def constrain_pool(pool):
    """Inside a compiled serving call: pin a paged pool (``dantinox.kv.paged``) to its layout on the
    ambient mesh, so calls hand the pool to each other unchanged (no resharding, no recompilation): per-head
    arrays [N, P, K, D] split K over model where it divides, anything else (MLA's [N, P, C]) replicated.
    A no-op without an ambient (data, model) mesh."""
    sizes = ambient_mesh_shape()
    if sizes is None:
        return pool

    def spec(a):
        heads = "model" if a.ndim == 4 and sizes["model"] > 1 and a.shape[2] % sizes["model"] == 0 else None
        return P(None, None, heads, None) if a.ndim == 4 else P()

    return tuple(type(layer)(*(jax.lax.with_sharding_constraint(a, spec(a)) for a in layer)) for layer in pool)
