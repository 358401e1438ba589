"""ModelConfig: one frozen, validated description of a decoder-only transformer.

Every module reads its sizes from here; nothing else carries defaults. Validation runs once, in
``__post_init__``, and every error names the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import jax.numpy as jnp

PARADIGMS = ("ar",)
ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")
MLA_FIELDS = ("kv_latent_dim", "rope_head_dim", "q_latent_dim")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}


class ConfigError(ValueError):
    """A configuration field holds a value that is not allowed."""


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"ModelConfig.{name}={value!r} is not allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def canonical_dtype(name: str, value: Any) -> str:
    """Map 'fp32'/'bf16'/'float32'/'bfloat16' (any case) to the canonical name; raise ConfigError otherwise."""
    if not isinstance(value, str):
        _fail(name, value, f"a dtype name, one of {sorted(DTYPES) + sorted(DTYPE_ALIASES)}")
    key = DTYPE_ALIASES.get(value.lower(), value.lower())
    if key not in DTYPES:
        _fail(name, value, f"one of {sorted(DTYPES) + sorted(DTYPE_ALIASES)}")
    return key


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (RoPE, RMSNorm, SwiGLU, tied embeddings).

    Fields:
      paradigm: "ar" (autoregressive, causal attention).
      attention: "mha" (kv_heads = n_heads), "gqa" (1 < kv_heads < n_heads, dividing n_heads),
        "mqa" (kv_heads = 1) or "mla" (multi-head latent attention, DeepSeek-V2, arXiv 2405.04434, section
        2.1; see dantinox.mla). GQA: Ainslie et al. 2023, "GQA"; MQA: Shazeer 2019.
      kv_heads: number of key/value heads K; defaults to n_heads for "mha" and 1 for "mqa". Must be None for
        "mla": there every query head has its own key and value, up-projected from one shared latent, so the
        cache holds no KV heads at all (kv_heads stays None and group_size is 1).
      dim: model width; must equal n_heads * head_size.
      n_heads: query heads H.  head_size: D.  num_blocks: decoder layers L.
      vocab_size: V.  max_context: S, the static cache length in tokens.
      mlp_hidden: SwiGLU hidden width (default 4 * dim).
      rope_theta: RoPE base (Su et al. 2021, "RoFormer").  norm_eps: RMSNorm epsilon.
      tie_embeddings: the output projection is the transposed token embedding.
      compute_dtype: "float32" or "bfloat16" (activations and matmuls; parameters stay float32).
      cache_dtype: "float32" or "bfloat16" (dtype of the stored keys and values).
      sliding_window: if set, a query attends only to the last `sliding_window` positions (itself included).
        The static cache still holds max_context slots.
      kv_latent_dim: MLA only (required there, None otherwise): d_c, the width C of the per-token latent c_kv
        that the cache stores instead of per-head keys and values.
      rope_head_dim: MLA only: d_rope, the width R of the decoupled RoPE key shared by all heads (and of each
        head's RoPE query part). None means head_size // 2 rounded up to even; 0 drops the RoPE key (the
        cache then holds only the latent, but attention carries no position signal).
      q_latent_dim: MLA only: width of the compressed query latent c_q; None projects queries directly.
      mla_absorb: MLA only: True (default) runs attention against the latent directly, with the key
        up-projection folded into the query and the value up-projection applied after attention (the
        "absorbed" decode of DeepSeek-V2 section 2.1.2); False expands the latent to per-head K and V
        (the naive path, kept as a reference). Both give the same logits and the same parameters.

    Raises:
      ConfigError: any field out of range, with the field, the value and the allowed values.
    """

    paradigm: str = "ar"
    attention: str = "gqa"
    kv_heads: int | None = 2
    dim: int = 256
    n_heads: int = 8
    head_size: int = 32
    num_blocks: int = 12
    vocab_size: int = 256
    max_context: int = 512
    mlp_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    compute_dtype: str = "float32"
    cache_dtype: str = "float32"
    sliding_window: int | None = None
    kv_latent_dim: int | None = None
    rope_head_dim: int | None = None
    q_latent_dim: int | None = None
    mla_absorb: bool = True

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        if self.paradigm not in PARADIGMS:
            _fail("paradigm", self.paradigm, f"one of {PARADIGMS}")
        if self.attention not in ATTENTION_KINDS:
            _fail("attention", self.attention, f"one of {ATTENTION_KINDS}")
        for name in ("dim", "n_heads", "head_size", "num_blocks", "vocab_size", "max_context"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                _fail(name, value, "a positive integer")
        if self.dim != self.n_heads * self.head_size:
            _fail("dim", self.dim, f"must equal n_heads * head_size = {self.n_heads} * {self.head_size}"
                  f" = {self.n_heads * self.head_size}")
        if self.head_size % 2:
            _fail("head_size", self.head_size, "an even integer (RoPE rotates pairs)")
        set_("kv_heads", self._resolve_kv_heads())
        if self.mlp_hidden is None:
            set_("mlp_hidden", 4 * self.dim)
        elif not isinstance(self.mlp_hidden, int) or self.mlp_hidden <= 0:
            _fail("mlp_hidden", self.mlp_hidden, "a positive integer or None (4 * dim)")
        if not self.rope_theta > 0:
            _fail("rope_theta", self.rope_theta, "a positive number")
        if not self.norm_eps > 0:
            _fail("norm_eps", self.norm_eps, "a positive number")
        set_("compute_dtype", canonical_dtype("compute_dtype", self.compute_dtype))
        set_("cache_dtype", canonical_dtype("cache_dtype", self.cache_dtype))
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            _fail("sliding_window", self.sliding_window, "a positive integer or None")
        self._check_mla_fields()

    def _check_mla_fields(self) -> None:
        if self.attention != "mla":
            for name in MLA_FIELDS:
                if getattr(self, name) is not None:
                    _fail(name, getattr(self, name), f"None for attention={self.attention!r} "
                          "(only attention='mla' uses it)")
            return
        if not _is_int(self.kv_latent_dim) or self.kv_latent_dim <= 0:
            _fail("kv_latent_dim", self.kv_latent_dim, "a positive integer for attention='mla' (the latent "
                  "width d_c, e.g. 4 * head_size)")
        if self.rope_head_dim is None:
            object.__setattr__(self, "rope_head_dim", self.head_size // 2 + (self.head_size // 2) % 2)
        elif not _is_int(self.rope_head_dim) or self.rope_head_dim < 0 or self.rope_head_dim % 2:
            _fail("rope_head_dim", self.rope_head_dim, "an even integer >= 0 for attention='mla' (RoPE "
                  "rotates pairs), or None for head_size // 2")
        if self.q_latent_dim is not None and (not _is_int(self.q_latent_dim) or self.q_latent_dim <= 0):
            _fail("q_latent_dim", self.q_latent_dim, "a positive integer or None (no query compression)")
        if not isinstance(self.mla_absorb, bool):
            _fail("mla_absorb", self.mla_absorb, "True (absorbed attention on the latent) or False (naive)")

    def _resolve_kv_heads(self) -> int | None:
        k, h = self.kv_heads, self.n_heads
        if self.attention == "mla":
            if k is not None:
                _fail("kv_heads", k, "None for attention='mla' (each query head gets its own key and value "
                      "from the shared latent; size the cache with kv_latent_dim)")
            return None
        if self.attention == "mha":
            if k not in (None, h):
                _fail("kv_heads", k, f"equal to n_heads={h} for attention='mha' (or None)")
            return h
        if self.attention == "mqa":
            if k not in (None, 1):
                _fail("kv_heads", k, "1 for attention='mqa' (or None)")
            return 1
        if k is None or not isinstance(k, int) or k <= 0 or h % k:
            divisors = [d for d in range(1, h + 1) if h % d == 0]
            _fail("kv_heads", k, f"a divisor of n_heads={h} for attention='gqa': one of {divisors}")
        return k

    # Derived quantities -------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """G = n_heads // kv_heads: query heads that share one KV head (query head h uses KV head h // G).

        1 for MLA, where every query head has its own (up-projected) key and value.
        """
        return 1 if self.kv_heads is None else self.n_heads // self.kv_heads

    @property
    def rope_dim(self) -> int:
        """Width of the rotary part of each query/key: rope_head_dim for MLA, head_size otherwise."""
        return self.rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def jnp_compute_dtype(self):
        return DTYPES[self.compute_dtype]

    @property
    def jnp_cache_dtype(self):
        return DTYPES[self.cache_dtype]

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with `changes` applied and validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """Build from a mapping; unknown keys raise ConfigError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**dict(data))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named preset (see PRESETS) with `overrides` applied."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; allowed: {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # The seeds' reference shape (the one ../shared/peers measures).
    "reference": dict(attention="gqa", kv_heads=2, dim=256, n_heads=8, head_size=32, num_blocks=12,
                      vocab_size=256, max_context=512, mlp_hidden=1024),
    "reference-mha": dict(attention="mha", kv_heads=None, dim=256, n_heads=8, head_size=32,
                          num_blocks=12, vocab_size=256, max_context=512, mlp_hidden=1024),
    "reference-mqa": dict(attention="mqa", kv_heads=None, dim=256, n_heads=8, head_size=32,
                          num_blocks=12, vocab_size=256, max_context=512, mlp_hidden=1024),
    # The reference shape with multi-head latent attention (the latent sizes ../shared/peers measures).
    "reference-mla": dict(attention="mla", kv_heads=None, dim=256, n_heads=8, head_size=32, num_blocks=12,
                          vocab_size=256, max_context=512, mlp_hidden=1024, kv_latent_dim=128,
                          rope_head_dim=16, q_latent_dim=128),
    # The shape of the bundled Divina Commedia model (fits in 8 MB of float32 weights).
    "dante": dict(attention="gqa", kv_heads=2, dim=192, n_heads=6, head_size=32, num_blocks=4,
                  vocab_size=96, max_context=256, mlp_hidden=512),
    # The acceptance cases' tiny model (../shared/cases/ACCEPTANCE.md).
    "tiny": dict(attention="mha", kv_heads=None, dim=64, n_heads=8, head_size=8, num_blocks=2,
                 vocab_size=128, max_context=32, mlp_hidden=128),
    "tiny-mla": dict(attention="mla", kv_heads=None, dim=64, n_heads=8, head_size=8, num_blocks=2,
                     vocab_size=128, max_context=32, mlp_hidden=128, kv_latent_dim=16, rope_head_dim=8),
}


def config_field_names() -> list[str]:
    """Names of the ModelConfig fields (for CLI overrides)."""
    return [f.name for f in dataclasses.fields(ModelConfig)]

