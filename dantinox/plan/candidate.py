"""A candidate deployment: the serving settings the planner sweeps, and its serve flags.

Fields: kv_dtype (cache dtype: float32, bfloat16, or int8 where available), quantize (weights: none, bf16,
int8, int4, q8_0), block_size P (tokens; None: serve's default for the model and kv_dtype, 16 or, with
per-channel int8 keys, the key group: ``for_model``), max_running (sequences), max_batched_tokens (prefill
tokens per step), max_decode_steps (multi-step decode, 1 = off), preemption (recompute or swap),
prefix_caching, replicas (engines, one device each), routing (round_robin, least_tokens, prefix_affinity) and
spec_tokens (k proposed tokens per speculative verify call, n-gram proposals; 0 = no speculation;
plan/speculation.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..serving.engine import EngineConfig
from ..serving.step_plan import default_block_size
from .speculation import check_spec_tokens

ROUTING = ("round_robin", "least_tokens", "prefix_affinity")
_INTS = ("block_size", "max_running", "max_batched_tokens", "max_decode_steps", "replicas")   # block_size: or None


@dataclass(frozen=True)
class Candidate:
    """One deployment to simulate. Raises ValueError naming the field for a bad value."""

    name: str = "baseline"
    kv_dtype: str = "float32"
    quantize: str = "none"
    block_size: int | None = None
    max_running: int = 16
    max_batched_tokens: int = 64
    max_decode_steps: int = 8
    preemption: str = "recompute"
    prefix_caching: bool = True
    replicas: int = 1
    routing: str = "round_robin"
    spec_tokens: int = 0

    def __post_init__(self):
        for name in _INTS:
            v = getattr(self, name)
            if v is None and name == "block_size":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"candidate {self.name!r}: {name}={v!r} is not allowed: an integer >= 1")
        if self.max_decode_steps > 64:
            raise ValueError(f"candidate {self.name!r}: max_decode_steps={self.max_decode_steps} is not "
                             "allowed: at most 64")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"candidate {self.name!r}: preemption={self.preemption!r} is not allowed: "
                             "recompute or swap")
        if self.routing not in ROUTING:
            raise ValueError(f"candidate {self.name!r}: routing={self.routing!r} is not allowed: one of {ROUTING}")
        check_spec_tokens(f"candidate {self.name!r}: spec_tokens", self.spec_tokens)
        if self.quantize not in ("none", "bf16", "int8", "int4", "q8_0"):
            raise ValueError(f"candidate {self.name!r}: quantize={self.quantize!r} is not allowed: none, bf16, "
                             "int8, int4, q8_0")

    def for_model(self, cfg) -> "Candidate":
        """This candidate with its block size settled for model config ``cfg``: a None block_size becomes
        ``dantinox.serving.step_plan.default_block_size`` of the kv_dtype cache (16, or the key group with
        per-channel int8 keys, the int8 default on MHA / GQA / MQA, whose blocks must hold whole groups)."""
        if self.block_size is not None:
            return self
        return dataclasses.replace(self, block_size=default_block_size(cfg.replace(cache_dtype=self.kv_dtype)))

    def engine_config(self, num_blocks: int | None = None):
        """The EngineConfig of one replica (pool of num_blocks blocks, or the engine's default sizing)."""
        return EngineConfig(block_size=self.block_size, num_blocks=num_blocks, max_running=self.max_running,
                            max_batched_tokens=self.max_batched_tokens, max_decode_steps=self.max_decode_steps,
                            preemption=self.preemption, enable_prefix_caching=self.prefix_caching)

    def serve_flags(self) -> dict:
        """The ``dantinox serve --config`` keys for one replica (flag names without dashes)."""
        sized = {} if self.block_size is None else {"block_size": self.block_size}   # None: serve's own default
        return {**sized, "max_running": self.max_running, "max_batched_tokens": self.max_batched_tokens,
                "max_decode_steps": self.max_decode_steps, "policy": self.preemption,
                "no_prefix_caching": not self.prefix_caching,
                **({"speculative": "ngram", "spec_tokens": self.spec_tokens} if self.spec_tokens else {})}

    def to_dict(self) -> dict:
        """Every field (JSON-ready); spec_tokens only when speculating (plans without it keep their bytes)."""
        d = dataclasses.asdict(self)
        if not self.spec_tokens:
            del d["spec_tokens"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        """Raises ValueError naming an unknown field or a bad value."""
        if not isinstance(d, dict):
            raise ValueError(f"a candidate must be a mapping of fields, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"candidate {d.get('name')!r}: unknown field {unknown[0]!r}; allowed: "
                             f"{', '.join(sorted(known))}")
        return cls(**d)


def default_candidates() -> list[Candidate]:
    """The default sweep: a float baseline, batch / chunk / multi-step / preemption variations, two replicas
    under each router, and the maximum-throughput configuration (largest batch and chunks, int8 everything).
    Block sizes are serve's defaults for the model (``Candidate.for_model``) except block-32's."""
    C = Candidate
    return [
        C("baseline"),
        C("running-8", max_running=8),
        C("running-32", max_running=32),
        C("chunk-32", max_batched_tokens=32),
        C("chunk-128", max_batched_tokens=128),
        C("single-step", max_decode_steps=1),
        C("block-32", block_size=32),
        C("swap", preemption="swap"),
        C("kv-bf16", kv_dtype="bfloat16"),
        C("2x-round-robin", replicas=2, routing="round_robin"),
        C("2x-least-tokens", replicas=2, routing="least_tokens"),
        C("2x-prefix-affinity", replicas=2, routing="prefix_affinity"),
        C("max-throughput", kv_dtype="int8", quantize="int8", max_running=64, max_batched_tokens=256,
          max_decode_steps=16),
    ]


def speculative_candidates(ks: tuple = (2, 4, 8)) -> list[Candidate]:
    """The baseline with n-gram speculation at each k (added to the default sweep when an acceptance rate is
    given: ``dantinox plan --spec-acceptance A`` or a trace's spec_acceptance)."""
    return [Candidate(f"spec-{k}", spec_tokens=k) for k in ks]
