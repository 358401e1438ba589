"""Profile: time the serving engine's compiled calls on this machine and fit the simulator's CostModel.

Prefill and decode are measured apart: forward_step at a few (B, T) shapes (decode rows T = 1, prefill chunks
T > 1), decode_steps at a few (B, M) shapes with 1 and n iterations (so the call overhead and the per-step cost
separate), block reads and writes (swap) and copy-on-write copies. Each shape is compiled once, then timed as
the median of a few runs. The machine's memory bandwidth (a streaming jitted add) and matmul rate (a jitted
float32 matmul) are measured briefly, and every timed call is set against the time its bytes (weights + KV
read) and its FLOPs would take at those rates: the bottleneck report.

profile.json records the model digest (sha256 of its weights file), its config, the dantinox version and
the engine configuration; ``check_profile`` refuses a profile of another model or version, naming what
differs. The machine is recorded but not checked: a profile from another machine may be used unchanged.

A profile is per-machine data, and with ``mesh`` per mesh shape too: the engine is then the
``ShardedPagedEngine`` over that mesh (parameters sharded after the variant's kv_dtype and quantize are
applied), every call is timed with the mesh in scope, so the times include the collectives, and
profile.json records ``"mesh": {"data": D, "model": M}`` and the device count under "machine". Like the
machine, the mesh is recorded, not checked: a profile is only meaningful for the mesh it names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import __version__
from .cost_model import CostModel

FORWARD_SHAPES = ((1, 1), (4, 1), (16, 1), (1, 16), (1, 64), (4, 64))
DECODE_SHAPES = ((1, 4), (16, 4), (16, 16))   # (B, M) at block size 16: 64 and 256 attended slots
PROFILE_FORMAT = 1


def weights_digest(run_dir: str) -> str:
    """sha256 (hex) of the run directory's model.safetensors. Raises FileNotFoundError."""
    h = hashlib.sha256()
    with open(os.path.join(run_dir, "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _median_seconds(fn, repeats: int, warm: int = 3) -> float:
    """Median seconds of ``repeats`` calls of fn after ``warm`` untimed ones (the first compiles; the next
    ones run noticeably slower on the CPU while caches and the thread pool warm up)."""
    for _ in range(warm):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def machine_rates(repeats: int = 5) -> dict:
    """{"bandwidth_bytes_per_s", "matmul_flops_per_s"}: a jitted in-place streaming add over 64 MiB (read +
    write, the buffer donated so no fresh pages are touched) and a jitted 1024 x 1024 float32 matmul, best of
    ``repeats``."""
    from functools import partial

    state = {"x": jnp.ones((16 << 20,), jnp.float32)}
    add = partial(jax.jit, donate_argnums=0)(lambda a: a + 1.0)

    def stream():
        state["x"] = add(state["x"])
        return state["x"]
    a = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(lambda m: m @ m)
    t_add = min(_median_seconds(stream, 1, 1) for _ in range(repeats))
    t_mm = min(_median_seconds(lambda: mm(a), 1, 1) for _ in range(repeats))
    return {"bandwidth_bytes_per_s": 2 * state["x"].nbytes / t_add, "matmul_flops_per_s": 2 * 1024 ** 3 / t_mm}


def _fit(rows: list, ys: list) -> tuple:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float), np.asarray(ys, float), rcond=None)
    return tuple(float(max(c, 0.0)) for c in coef)


def _time_decode(engine, B: int, M: int, n: int, max_steps: int, repeats: int) -> float:
    """Seconds of one decode_steps call of B rows over M table entries running n iterations (writes dropped)."""
    from ..sampling import SamplingParams
    from ..serving.runner import decode_steps

    z = np.zeros(B, np.int32)
    table = np.full((B, M), engine.allocator.num_blocks, np.int32)   # every write dropped
    sampling = SamplingParams(np.zeros(B, np.float32), z, np.ones(B, np.float32))

    def call():
        out, engine.pool = decode_steps(engine.graph, engine.params, engine.pool, z, z, np.full(B, n, np.int32),
                                        table, np.zeros(B, np.uint32), z, sampling, max_steps=max_steps)
        return out
    return _median_seconds(call, repeats)


def _time_forward(engine, B: int, T: int, repeats: int) -> float:
    return _median_seconds(lambda: engine._call_forward([], B, T)[0], repeats)


def time_engine(engine, repeats: int = 15, max_steps: int = 8) -> dict:
    """Time ``engine``'s compiled calls (nothing is written to its pool). Returns the measured points:
    {"forward": {"B,T": s}, "decode": {"B,M,n": s}, "swap_out": s, "swap_in": s, "copy": s}."""
    points = {"forward": {}, "decode": {}}
    for B, T in FORWARD_SHAPES:
        if T <= engine.chunk_buckets[-1]:
            points["forward"][f"{B},{T}"] = _time_forward(engine, B, T, repeats)
    for B, M in DECODE_SHAPES:
        M = min(M, engine.table_width)
        for n in (max_steps // 2, max_steps):  # not n = 1: a lone iteration carries the loop's start-up
            points["decode"][f"{B},{M},{n}"] = _time_decode(engine, B, M, n, max_steps, repeats)
    blocks = list(range(min(4, engine.allocator.num_blocks)))
    points["swap_out"] = _median_seconds(lambda: engine._read_host(blocks)[0][0], repeats)
    data = engine._read_host(blocks)
    points["swap_in"] = _median_seconds(lambda: (engine._write_host(blocks[:0], data), engine.pool)[1], repeats)
    points["copy"] = _median_seconds(lambda: (engine._copy_blocks([(0, 0)]), engine.pool)[1], repeats)
    return points


def fit_cost_model(points: dict, block_size: int) -> CostModel:
    """Least-squares CostModel from ``time_engine``'s points (see cost_model for the forms)."""
    fwd = points["forward"]
    shapes = [tuple(int(v) for v in k.split(",")) for k in fwd]
    forward = _fit([[1, B, B * T] for B, T in shapes], list(fwd.values()))
    dec = {tuple(int(v) for v in k.split(",")): s for k, s in points["decode"].items()}
    n_hi = max(n for _, _, n in dec)
    n_lo = min(n for _, _, n in dec)
    rows, ys, overheads = [], [], []
    for (B, M, n), s in dec.items():
        if n == n_hi:
            per_iter = max((s - dec[(B, M, n_lo)]) / (n_hi - n_lo), 0.0)
            rows.append([1, B, B * M * block_size])
            ys.append(per_iter)
            overheads.append(max(s - n_hi * per_iter, 0.0))
    return CostModel(forward=forward, decode_call=float(np.median(overheads)), decode_iter=_fit(rows, ys),
                     swap_out=points["swap_out"], swap_in=points["swap_in"], copy=points["copy"],
                     forward_overhead=points.get("forward_overhead", 0.0), scale=points.get("scale", 1.0),
                     points=dict(fwd))


def _burst(tag: str, vocab: int, requests: int = 8, prompt: int = 40, new: int = 20) -> list:
    """[(request id, prompt ids, options)]: the calibration burst (distinct prompts per tag, no prefix hits)."""
    from ..serving.request import SamplingOptions

    return [(f"{tag}{i}", [(97 * i + 13 * j + len(tag)) % (vocab - 1) + 1 for j in range(prompt)],
             SamplingOptions(new)) for i in range(requests)]


def calibrate_steps(engine, cost: CostModel) -> tuple[float, float]:
    """(forward_overhead seconds h, scale s) so that a real engine step of forward_step calls (prefill, or decode mixed
    with prefill) costs h + s x (its calls' fitted cost); multi-step decode steps are left as timed.

    A burst of 8 requests (40 prompt + 20 output tokens) runs through the real engine twice (the first pass
    compiles what it needs); each step of the second pass is timed, the simulator replays the same steps with
    ``cost`` (same scheduler code), and h, s are the least-squares fit (s >= 1, h >= 0). They cover what timing
    calls in isolation misses: host work per step (inputs, dispatch, fetch, bookkeeping), and calls running
    slower among other calls than alone."""
    from .simulate import SimReplica

    for tag in ("warm", "timed"):
        for rid, ids, opts in _burst(tag, engine.vocab_size):
            engine.add_request(ids, opts, request_id=rid)
        walls = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    rep = SimReplica(engine.cfg, engine.config, cost)
    for rid, ids, opts in _burst("timed", engine.vocab_size):
        rep.add(rid, ids, opts, 0.0)
    predicted, keep = [], []
    while rep.scheduler.waiting or rep.scheduler.running:
        predicted.append(rep.step()[0])
        keep.append(not rep.last_multi_step)
    n = min(len(walls), len(predicted))
    use = np.asarray(keep[:n])
    walls, predicted = np.asarray(walls[:n])[use], np.asarray(predicted[:n])[use]
    n = len(walls)
    if n < 2:
        return 0.0, 1.0
    h, s = np.linalg.lstsq(np.stack([np.ones(n), predicted], 1), walls, rcond=None)[0]
    if s < 1.0:      # calls no slower than alone: all of the difference is per-step host time
        s, h = 1.0, max(float(np.mean(walls - predicted)), 0.0)
    elif h < 0:      # no fixed part: a pure factor
        s, h = max(float(walls.sum() / max(predicted.sum(), 1e-12)), 1.0), 0.0
    return float(h), float(s)


def bottleneck_rows(cfg, points: dict, rates: dict, weights_bytes: int, kv_bytes_per_token: int,
                    block_size: int, n_params: int | None = None) -> list[dict]:
    """Per measured call: seconds measured, seconds at the bandwidth for its bytes (weights once + the KV
    slots it attends), seconds at the matmul rate for its FLOPs (2 x params x tokens + 4 x L x H x D x tokens
    x attended slots), the bound (the larger of the two) and the fraction of that bound reached."""
    n_params = n_params or weights_bytes / 4     # parameter count (weights_bytes may be int8 or bf16)
    L, H, D = cfg.num_blocks, cfg.n_heads, cfg.head_size
    rows = []
    for key, s in points["forward"].items():
        B, T = (int(v) for v in key.split(","))
        rows.append(_row("prefill" if T > 1 else "decode (one step)", key, s, B, T, cfg.max_context, n_params,
                         weights_bytes, kv_bytes_per_token, L * H * D, rates))
    for key, s in points["decode"].items():
        B, M, n = (int(v) for v in key.split(","))
        if n != max(int(k.split(",")[2]) for k in points["decode"]):
            continue
        rows.append(_row("decode (multi-step)", key, s / n, B, 1, M * block_size, n_params, weights_bytes,
                         kv_bytes_per_token, L * H * D, rates))
    return rows


def _row(kind, key, seconds, B, T, S, n_params, weights_bytes, kv_bpt, lhd, rates) -> dict:
    nbytes = weights_bytes + B * S * kv_bpt
    flops = 2 * n_params * B * T + 4 * lhd * B * T * S
    t_mem, t_flop = nbytes / rates["bandwidth_bytes_per_s"], flops / rates["matmul_flops_per_s"]
    return {"call": kind, "shape": key, "measured_s": seconds, "bytes": int(nbytes), "flops": int(flops),
            "memory_s": t_mem, "compute_s": t_flop, "bound": "memory" if t_mem >= t_flop else "compute",
            "efficiency": max(t_mem, t_flop) / seconds if seconds > 0 else 0.0}


def model_identity(run_dir: str, cfg) -> dict:
    """What a profile or plan is tied to: {"weights_sha256", "config", "dantinox_version"}."""
    return {"weights_sha256": weights_digest(run_dir), "config": cfg.to_dict() if hasattr(cfg, "to_dict")
            else dict(vars(cfg)), "dantinox_version": __version__}


def take_profile(run_dir: str, model, cfg, kv_dtype: str = "float32", quantize: str = "none",
                 repeats: int = 15, mesh=None) -> dict:
    """Profile the model's engine at block size 16 (decode buckets up to 16 rows, chunks up to 64 tokens),
    on ``mesh`` (a jax Mesh from ``dantinox.mesh.make_mesh``) when given, else on one device.
    Returns the profile dict (JSON-ready): identity, machine, mesh, rates, points, cost model, bottleneck rows.
    Raises ValueError for a kv_dtype / quantize this version cannot build, MeshError (a ValueError) when the
    model does not divide over the mesh."""
    from ..mesh import mesh_scope, mesh_shape
    from ..planner import kv_bytes_per_token, param_bytes
    from ..serving.engine import EngineConfig, PagedEngine
    from ..serving.sharded_engine import ShardedPagedEngine
    from .variants import apply_variant

    model, cfg = apply_variant(model, cfg, kv_dtype, quantize)
    config = EngineConfig(block_size=16, max_running=16, max_batched_tokens=64, num_blocks=64, max_decode_steps=8)
    engine = PagedEngine(model, config) if mesh is None else ShardedPagedEngine(model, config, mesh)
    with mesh_scope(mesh):  # the engine's own steps enter it too; the direct calls below need it
        points = time_engine(engine, repeats)
        points["forward_overhead"], points["scale"] = calibrate_steps(engine, fit_cost_model(points, 16))
    rates = machine_rates()
    weights = param_bytes(model)
    n_params = param_bytes(dataclasses.replace(cfg, cache_dtype="float32")) // 4   # float32 build: 4 B each
    kv_bpt = kv_bytes_per_token(cfg)
    return {"format": PROFILE_FORMAT, "identity": model_identity(run_dir, cfg), "kv_dtype": kv_dtype,
            "quantize": quantize, "block_size": 16,
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "device": str(jax.devices()[0].device_kind), "cpus": os.cpu_count(),
                        "devices": jax.device_count()},
            "mesh": mesh_shape(mesh),
            "rates": rates, "points": points, "cost_model": fit_cost_model(points, 16).to_dict(),
            "bottleneck": bottleneck_rows(cfg, points, rates, weights, kv_bpt, 16, n_params)}


def check_profile(profile: dict, identity: dict, where: str = "--profile") -> None:
    """Raise ValueError naming the first difference between the profile's identity and the model's: another
    format, dantinox version, weights digest or config field."""
    if profile.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{where}: profile format {profile.get('format')!r} is not allowed: {PROFILE_FORMAT}")
    theirs = profile.get("identity", {})
    if theirs.get("dantinox_version") != identity["dantinox_version"]:
        raise ValueError(f"{where}: the profile was taken with dantinox {theirs.get('dantinox_version')}, this is "
                         f"{identity['dantinox_version']}: profile again")
    if theirs.get("weights_sha256") != identity["weights_sha256"]:
        raise ValueError(f"{where}: the profile was taken on model weights sha256 "
                         f"{str(theirs.get('weights_sha256'))[:12]}..., this model's are "
                         f"{identity['weights_sha256'][:12]}...: profile this model")
    recorded = theirs.get("config", {})
    for key, value in identity["config"].items():
        theirs_value = recorded.get(key, _config_default(key))   # a field added since: its default
        if key != "cache_dtype" and theirs_value != value:
            raise ValueError(f"{where}: the profile's model has {key}={theirs_value!r}, "
                             f"this model has {key}={value!r}")


def _config_default(key: str):
    """The ModelConfig default of field `key` (None for an unknown field). A profile written before a config
    field existed was taken on a model with that field at its default, which leaves the model unchanged."""
    from ..config import ModelConfig
    for field in dataclasses.fields(ModelConfig):
        if field.name == key:
            return None if field.default is dataclasses.MISSING else field.default
    return None
