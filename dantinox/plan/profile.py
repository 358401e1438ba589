"""Profile: time the serving engine's compiled calls on this machine and fit the simulator's CostModel.

Prefill and decode are measured apart: forward_step at every (B, T) bucket the profiled engine compiles
(decode rows T = 1, prefill chunks T > 1), decode_steps at every batch bucket over the narrowest and the
widest block table with n / 2 and n iterations, block reads and writes (swap) and copy-on-write copies. Each
shape is compiled once, then timed as the median of a few runs. Two measurements then tie the isolated calls
to real serving: ``calibrate_steps`` runs a burst of requests through the real engine and fits, per step
kind, the host time and slowdown the isolated calls miss; ``measure_wake`` measures how much more the first
steps after an idle period cost, the first one and the few after it (on a CPU the caches, clock and worker
threads go cold while the engine waits for requests, so light-load latency exceeds what the isolated calls
say; docs/explanation/planning.md gives the measured effect). The machine's memory bandwidth (a streaming jitted add)
and matmul rate (a jitted float32 matmul) are measured briefly, and every timed call is set against the
time its bytes (weights + KV read) and its FLOPs would take at those rates: the bottleneck report.

Repeats: a profile is a sample of a cost that drifts (docs/explanation/planning.md measured 0.90-1.35x within minutes on
the 2-core host), so ``take_profile(samples=K)`` measures K times on one engine, the first after a warm-up pass
(``engine.warmup`` compiles every bucket, then one untimed time_engine pass), with ``cooldown_s`` seconds of
sleep between two samples so they spread over time. profile.json (format 3) keeps every sample's points and
cost model under "samples"; its top-level "points" / "cost_model" are sample 0's (what a reader of format 2
used). ``profile_cost_models`` returns one CostModel per sample from either format (format 2: one).

profile.json records the model digest (sha256 of its weights file), its config, the dantinox version and
the engine configuration; ``check_profile`` refuses a profile of another model or version, naming what
differs. The machine is recorded but not checked: a profile from another machine may be used unchanged.

A profile is per-machine data, and with ``mesh`` per mesh shape too: the engine is then the
``ShardedPagedEngine`` over that mesh (parameters sharded after the variant's kv_dtype and quantize are
applied), every call is timed with the mesh in scope, so the times include the collectives, and
profile.json records ``"mesh": {"data": D, "model": M}``, the machine's device count ("devices") and the
devices the profile ran on ("devices_used": the mesh's first D x M, else 1) under "machine". Like the
machine, the mesh is recorded, not checked: a profile is only meaningful for the mesh it names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from .._version import __version__
from ..budget.memory import kv_bytes_per_token, param_bytes
from ..config import ModelConfig
from ..generation.grammar import all_allowed_mask
from ..generation.sampling import make_sampling_params
from ..parallel.mesh import mesh_scope, mesh_shape
from ..serving.engine import EngineConfig, PagedEngine
from ..serving.request import SamplingOptions, no_bias
from ..serving.runner import decode_steps, forward_step
from ..serving.sharded_engine import ShardedPagedEngine
from ..serving.step_plan import default_block_size
from .cost_model import CostModel
from .speculation import check_spec_tokens
from .variants import apply_variant

PROFILE_FORMAT = 3
READABLE_FORMATS = (2, 3)   # 2: one sample (before --repeats)
WAKE_GAPS = (0.005, 0.02, 0.05, 0.15)   # idle seconds before a step, for measure_wake


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


def last_level_cache_bytes() -> int:
    """Bytes of the largest CPU cache Linux reports (/sys/devices/system/cpu/cpu0/cache); 0 when unknown."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=0)


def machine_rates(repeats: int = 5) -> dict:
    """{"bandwidth_bytes_per_s", "matmul_flops_per_s", "stream_bytes"}: a jitted in-place streaming add over
    stream_bytes (read + write, the buffer donated so no fresh pages are touched) and a jitted 1024 x 1024
    float32 matmul, best of ``repeats``. stream_bytes is 64 MiB or twice the last-level cache, whichever is
    larger, at most 1 GiB, so that the add measures memory and not a cache (a last-level cache larger than
    64 MiB would otherwise hold the whole buffer; docs/explanation/planning.md has the host where that happened)."""
    from functools import partial

    nbytes = min(max(64 << 20, 2 * last_level_cache_bytes()), 1 << 30)
    state = {"x": jnp.ones((nbytes // 4,), jnp.float32)}
    add = partial(jax.jit, donate_argnums=0)(lambda a: a + 1.0)

    def stream():
        state["x"] = add(state["x"])
        return state["x"]
    a = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(lambda m: m @ m)
    t_add = min(_median_seconds(stream, 1, 1) for _ in range(repeats))
    t_mm = min(_median_seconds(lambda: mm(a), 1, 1) for _ in range(repeats))
    return {"bandwidth_bytes_per_s": 2 * state["x"].nbytes / t_add, "matmul_flops_per_s": 2 * 1024 ** 3 / t_mm,
            "stream_bytes": int(state["x"].nbytes)}


def _fit(rows: list, ys: list) -> tuple:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float), np.asarray(ys, float), rcond=None)
    return tuple(float(max(c, 0.0)) for c in coef)


def _distinct_table(B: int, M: int, num_blocks: int) -> np.ndarray:
    """[B, M] int32 block tables giving each row its own blocks (wrapping around the pool), so a timed call
    gathers from as many distinct blocks as a real one (one block for every row would stay in the CPU cache)."""
    return (np.arange(B * M, dtype=np.int32).reshape(B, M) % num_blocks).astype(np.int32)


def _time_decode(engine, B: int, M: int, n: int, max_steps: int, repeats: int, warm: int = 3,
                 start: int | None = None) -> float:
    """Seconds of one decode_steps call of B rows over M table entries of distinct blocks running n
    iterations from slot ``start`` (default the middle of the table), its result fetched to the host as the
    engine does. It writes into the pool: profile an engine that holds no request."""
    return _median_seconds(_decode_call(engine, B, M, n, max_steps, start), repeats, warm)


def _decode_call(engine, B: int, M: int, n: int, max_steps: int, start: int | None = None):
    """A function running the decode_steps call that _time_decode times."""
    z = np.zeros(B, np.int32)
    start = np.full(B, M * engine.allocator.block_size // 2 if start is None else start, np.int32)
    tables = engine.cache.tables([], B, M)._replace(table=_distinct_table(B, M, engine.allocator.num_blocks))
    sampling = make_sampling_params(B)   # greedy

    def call():
        out, engine.pool = decode_steps(engine.graph, engine.params, engine.pool, z, start, np.full(B, n, np.int32),
                                        tables, np.zeros(B, np.uint32), z, sampling, max_steps=max_steps)
        return jax.device_get(out)
    return call


def _time_forward(engine, B: int, T: int, repeats: int, warm: int = 3) -> float:
    """Seconds of one forward_step of B rows x T new tokens over distinct blocks (as _time_decode)."""
    z = np.zeros(B, np.int32)
    ids, num_new = np.zeros((B, T), np.int32), np.full(B, T, np.int32)
    tables = engine.cache.tables([], B, engine.table_width)._replace(
        table=_distinct_table(B, engine.table_width, engine.allocator.num_blocks))
    sampling = make_sampling_params(B)   # greedy

    def call():
        out, _, engine.pool = forward_step(engine.graph, engine.params, engine.pool, ids, z, num_new, tables,
                                           np.zeros(B, np.uint32), z, sampling, np.bool_(False),
                                           all_allowed_mask(B, engine.vocab_size), *no_bias(B, engine.vocab_size))
        return np.asarray(out)
    return _median_seconds(call, repeats, warm)


def _decode_widths(engine, max_steps: int) -> list[tuple[int, int | None]]:
    """The (table entries M, attended slots S) a profile times decode at. An engine whose attention reads only
    the filled blocks (one table width, ``PagedEngine.reads_filled``) costs with the slots filled: S at the
    narrowest table bucket's tokens and at max_context, from a start S - n. Otherwise the cost follows the
    table's width: the narrowest and the widest bucket (S None: M P)."""
    if getattr(engine, "reads_filled", False):
        P, M = engine.allocator.block_size, engine.table_buckets[-1]
        return [(M, max(64, 2 * max_steps)), (M, min(M * P, engine.max_context))]
    return [(M, None) for M in sorted({engine.table_buckets[0], engine.table_buckets[-1]})]


def time_engine(engine, repeats: int = 15, max_steps: int = 8, warm: int = 3) -> dict:
    """Time ``engine``'s compiled calls (nothing is written to its pool): forward_step at every bucket it
    compiles (decode rows B x 1 and prefill chunks B x T), decode_steps at every decode batch bucket over the
    narrowest and the widest block table with max_steps / 2 and max_steps iterations, block reads and writes
    (swap) and a copy. Returns {"forward": {"B,T": s}, "decode": {"B,S,n": s}, "swap_out": s, "swap_in": s,
    "copy": s} (S = table width x block size: attended slots). Each call: the median of ``repeats`` runs after
    ``warm`` untimed ones."""
    points = {"forward": {}, "decode": {}}
    shapes = [(B, 1) for B in engine.decode_buckets]
    shapes += [(B, T) for B in engine.prefill_buckets for T in engine.chunk_buckets]
    for B, T in shapes:
        points["forward"][f"{B},{T}"] = _time_forward(engine, B, T, repeats, warm)
    P = engine.allocator.block_size
    for B in engine.decode_buckets:
        for M, S in _decode_widths(engine, max_steps):
            for n in (max_steps // 2, max_steps):  # not n = 1: a lone iteration carries the loop's start-up
                start = None if S is None else S - n
                points["decode"][f"{B},{S or M * P},{n}"] = _time_decode(engine, B, M, n, max_steps, repeats, warm,
                                                                         start)
    blocks = list(range(min(4, engine.allocator.num_blocks)))
    points["swap_out"] = _median_seconds(lambda: engine._read_host(blocks)[0][0], repeats)
    data = engine._read_host(blocks)
    points["swap_in"] = _median_seconds(lambda: (engine._write_host(blocks[:0], data), engine.pool)[1], repeats)
    points["copy"] = _median_seconds(lambda: (engine._copy_blocks([(0, 0)]), engine.pool)[1], repeats)
    return points


def fit_cost_model(points: dict) -> CostModel:
    """The CostModel of ``time_engine``'s points (see cost_model for the forms), with the calibration
    ("calibration": calibrate_steps' dict) and wake points ("wake") when the points carry them."""
    fwd = points["forward"]
    shapes = [tuple(int(v) for v in k.split(",")) for k in fwd]
    forward = _fit([[1, B, B * T] for B, T in shapes], list(fwd.values()))
    dec = {tuple(int(v) for v in k.split(",")): s for k, s in points["decode"].items()}
    n_hi = max(n for _, _, n in dec)
    n_lo = min(n for _, _, n in dec)
    rows, ys, overheads = [], [], []
    for (B, S, n), s in dec.items():
        if n == n_hi:
            per_iter = max((s - dec[(B, S, n_lo)]) / (n_hi - n_lo), 0.0)
            rows.append([1, B, B * S])
            ys.append(per_iter)
            overheads.append(max(s - n_hi * per_iter, 0.0))
    calibration = points.get("calibration", {})
    return CostModel(forward=forward, decode_call=float(np.median(overheads)), decode_iter=_fit(rows, ys),
                     swap_out=points["swap_out"], swap_in=points["swap_in"], copy=points["copy"],
                     **{k: float(v) for k, v in calibration.items() if k in _CALIBRATED},
                     **{k: tuple(calibration[k]) for k in ("forward_spread", "decode_spread") if k in calibration},
                     wake=tuple(tuple(p) for p in points.get("wake", ())),
                     cold_window=float(points.get("cold_window", 0.0)),
                     points=dict(fwd), decode_points=dict(points["decode"]),
                     verify_points=dict(points.get("verify", {})))


_CALIBRATED = ("forward_overhead", "scale", "decode_overhead", "decode_scale", "spread_correlation")


CALIBRATION_CONTEXT = 1024   # the calibration workload's lengths stop growing with the context here


def _burst(tag: str, vocab: int, max_context: int, requests: int = 24) -> list:
    """[(request id, prompt ids, options)]: a calibration workload of distinct prompts (no prefix hits) of 8 to
    about L / 4 tokens, asking 4 to about L / 8 new tokens, L = min(max_context, CALIBRATION_CONTEXT);
    calibrate_steps adds one every ``ARRIVAL_STEPS`` engine steps, so prefill chunks, mixed steps and
    multi-step decode calls over a range of batch sizes all occur. L is capped because the workload fits two
    numbers per step kind, which its mix of calls decides, not its lengths: uncapped, an 8192-token model
    (SmolLM2) ran 24 requests of up to 2048 + 1024 tokens three times per sample, tens of minutes on a CPU."""
    max_context = min(max_context, CALIBRATION_CONTEXT)
    prompt_span, new_span = max(max_context // 4 - 8, 1), max(max_context // 8 - 4, 1)
    offset = zlib.crc32(tag.encode())   # each run its own prompts: "timed" and "again" (the same length) once
    out = []                            # shared them, and the second run hit the first one's prefix cache
    for i in range(requests):
        prompt, new = 8 + (37 * i) % prompt_span, 4 + (23 * i) % new_span
        ids = [(97 * i + 13 * j + offset) % (vocab - 1) + 1 for j in range(prompt)]
        out.append((f"{tag}{i}", ids, SamplingOptions(new)))
    return out


ARRIVAL_STEPS = 2   # engine steps between two arrivals of the calibration workload


def step_cost(cost: CostModel, calls: list) -> float:
    """Seconds the cost model gives the device calls of one engine step (``PagedEngine.step_calls``)."""
    seconds = 0.0
    for call in calls:
        if call[0] == "forward":
            seconds += cost.forward_cost(call[1], call[2])
        elif call[0] == "decode":
            seconds += cost.decode_cost(call[1], call[2], call[3])
        else:
            seconds += {"swap_out": cost.swap_out, "swap_in": cost.swap_in, "copy": cost.copy}[call[0]]
    return seconds


def calibrate_steps(engine, cost: CostModel, warm: bool = True) -> dict:
    """{"forward_overhead": h, "scale": s, "decode_overhead": h', "decode_scale": s', "forward_spread": [..],
    "decode_spread": [..], "spread_correlation": rho}: a real engine step of forward_step calls costs h + s x (its
    calls' modelled cost), a multi-step decode step h' + s' x (its call's); the spreads are the quantiles of real
    / fitted step time (``spread_quantiles``), which the simulator draws from, consecutive draws correlated by
    rho (``spread_correlation``: the two timed runs' lag-1 correlation).

    The workload of ``_burst`` runs through the real engine three times, a request added every ARRIVAL_STEPS
    steps and the engine never idle: once to warm up, then twice with every step timed together with the calls
    it made (``engine.step_calls``); h, s are fitted per kind (see _fit_overhead). They cover what timing calls
    in isolation misses: host work per step (scheduling, inputs, dispatch, fetch, bookkeeping per token), and
    calls running slower among other calls than alone. warm=False skips the warm-up run (for an engine that
    has already run the workload: the profile's second and later samples; on SmolLM2 each run took 30-45 s)."""
    if warm:
        _run_workload(engine, "warm", cost)
    runs = [_run_workload(engine, "timed", cost), _run_workload(engine, "again", cost)]
    steps = runs[0] + runs[1]
    out = {}
    for kind, (h_key, s_key) in (("forward", ("forward_overhead", "scale")),
                                 ("decode", ("decode_overhead", "decode_scale"))):
        pairs = [(p, w) for k, p, w in steps if k == kind]
        out[h_key], out[s_key] = _fit_overhead(pairs)
        out[f"{kind}_spread"] = spread_quantiles(pairs, out[h_key], out[s_key])
    fits = {"forward": (out["forward_overhead"], out["scale"]), "decode": (out["decode_overhead"], out["decode_scale"])}
    out["spread_correlation"] = spread_correlation(runs, fits)
    return out


SPREAD_STEPS = 20   # the spread keeps the quantiles at probabilities 0, 1/20, .., 1


def spread_quantiles(pairs: list, h: float, s: float) -> list:
    """The SPREAD_STEPS + 1 quantiles of wall / (h + s x predicted) over [(predicted, wall)] seconds (the
    cost model's forward_spread / decode_spread), divided by the mean of a draw from them, so the draws vary a
    step's time without moving its mean (h and s keep deciding throughput); [] for fewer than 2 steps."""
    if len(pairs) < 2:
        return []
    ratios = [w / max(h + s * p, 1e-12) for p, w in pairs]
    q = np.maximum(np.maximum.accumulate(np.quantile(np.asarray(ratios, float),
                                                     np.linspace(0.0, 1.0, SPREAD_STEPS + 1))), 1e-6)
    mean = float(np.mean((q[1:] + q[:-1]) / 2))   # the mean of a draw (linear between the quantiles)
    return [float(x / mean) for x in q]


MAX_CORRELATION = 0.95   # the fitted lag-1 correlation is clipped to [0, this]


def spread_correlation(runs: list, fits: dict) -> float:
    """rho of the spread's Gaussian-copula AR(1) draws (spread_draws.py): the lag-1 correlation of consecutive
    steps' normal scores, pooled over ``runs`` ([[(kind, predicted s, wall s)], ...], each a run of steps back
    to back; pairs never straddle two runs), clipped to [0, MAX_CORRELATION]. fits: {kind: (h, s)}.

    A step's normal score is Phi^-1(rank / (n + 1)) of its ratio wall / (h + s x predicted) among the n steps of
    its kind in its run (van der Waerden's normal scores: the rank-based estimate of a Gaussian copula's
    correlation; ranking per kind puts forward and decode steps, whose ratios differ in scale, on one footing,
    and ranking per run leaves out a change of level between the runs, which the profile's K samples and
    their interval already carry). 0.0 for fewer than 3 pairs or no variation. A negative estimate is clipped
    to 0 (slow steps do not alternate with fast ones on a host; over a few dozen steps it is noise), and 1
    would freeze the draws."""
    pairs = []
    for run in runs:
        z = _normal_scores([(k, w / max(fits[k][0] + fits[k][1] * p, 1e-12)) for k, p, w in run])
        pairs += list(zip(z, z[1:]))
    if len(pairs) < 3:
        return 0.0
    x, y = (np.asarray(v, float) for v in zip(*pairs))
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return float(min(max(np.corrcoef(x, y)[0, 1], 0.0), MAX_CORRELATION))


def _normal_scores(ratios: list) -> list:
    """[Phi^-1(r / (n + 1))] per (kind, ratio), r the ratio's rank among the n of its kind (ties: mean rank)."""
    from statistics import NormalDist

    out = [0.0] * len(ratios)
    for kind in {k for k, _ in ratios}:
        idx = [i for i, (k, _) in enumerate(ratios) if k == kind]
        values = np.asarray([ratios[i][1] for i in idx], float)
        order = np.argsort(values, kind="stable")
        ranks = np.empty(len(idx))
        ranks[order] = np.arange(1, len(idx) + 1)
        for v in np.unique(values):             # ties share their mean rank
            ranks[values == v] = ranks[values == v].mean()
        for i, r in zip(idx, ranks):
            out[i] = NormalDist().inv_cdf(float(r) / (len(idx) + 1))
    return out


def _run_workload(engine, tag: str, cost: CostModel) -> list:
    """Run the calibration workload (tagged request ids) through ``engine``. Returns [(kind, modelled seconds
    of the step's calls, wall seconds)] per step."""
    pending, steps, count = _burst(tag, engine.vocab_size, engine.max_context), [], 0
    while pending or engine.has_unfinished():
        if pending and count % ARRIVAL_STEPS == 0:
            rid, ids, opts = pending.pop(0)
            engine.add_request(ids, opts, request_id=rid)
        count += 1
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        if engine.step_calls:
            kind = "decode" if any(c[0] == "decode" for c in engine.step_calls) else "forward"
            steps.append((kind, step_cost(cost, engine.step_calls), wall))
    return steps


def _fit_overhead(pairs: list) -> tuple[float, float]:
    """(h, s) of wall = h + s x predicted over [(predicted, wall)], least squares on the relative error (so
    small steps count as much as large ones) with h >= 0 and s > 0."""
    if len(pairs) < 2:
        return 0.0, 1.0
    predicted, walls = (np.asarray(v, float) for v in zip(*pairs))
    w = 1.0 / np.maximum(walls, 1e-9)
    h, s = np.linalg.lstsq(np.stack([w, predicted * w], 1), walls * w, rcond=None)[0]
    if h < 0 or s <= 0:   # no fixed part: a pure factor
        return 0.0, float(np.median(walls / np.maximum(predicted, 1e-12)))
    return float(h), float(s)


def measure_wake(engine, gaps: tuple = WAKE_GAPS, repeats: int = 5, warming_calls: int = 8) -> tuple:
    """(points [(idle seconds, extra seconds, slower fraction)], cold_window seconds): what an idle period
    costs the steps after it.

    The call is a one-row multi-step decode over the narrowest table (the steps that follow a request's
    prefill at light load). For each gap: sleep, then time ``warming_calls`` calls back to back; the extra is
    the first call's time minus the call's time without idle, the slower fraction the mean excess of the next
    ones relative to it (medians over ``repeats``). cold_window is the time those calls take without idle."""
    n = engine.config.max_decode_steps
    call = _decode_call(engine, 1, engine.table_buckets[0], n, n)

    def timed() -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0
    for _ in range(5):
        timed()
    busy = float(np.median([timed() for _ in range(4 * repeats)]))
    points = []
    for gap in gaps:
        runs = []
        for _ in range(repeats):
            time.sleep(gap)
            runs.append([timed() for _ in range(warming_calls)])
        median = np.median(np.asarray(runs), axis=0)
        points.append((gap, max(float(median[0]) - busy, 0.0), max(float(median[1:].mean()) / busy - 1.0, 0.0)))
    return points, warming_calls * busy


def bottleneck_rows(cfg, points: dict, rates: dict, weights_bytes: int, kv_bytes_per_token: int,
                    n_params: int | None = None) -> list[dict]:
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
        B, S, n = (int(v) for v in key.split(","))
        if n != max(int(k.split(",")[2]) for k in points["decode"]):
            continue
        rows.append(_row("decode (multi-step)", key, s / n, B, 1, S, n_params, weights_bytes,
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


def repeat_samples(measure, samples: int, cooldown_s: float = 0.0, sleep=time.sleep) -> list:
    """[measure() for each of ``samples`` samples], sleeping ``cooldown_s`` seconds between two of them.
    Raises ValueError naming ``samples`` (an integer >= 1) or ``cooldown_s`` (a number >= 0)."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"samples={samples!r} is not allowed: an integer >= 1")
    if not isinstance(cooldown_s, (int, float)) or isinstance(cooldown_s, bool) or cooldown_s < 0:
        raise ValueError(f"cooldown_s={cooldown_s!r} is not allowed: seconds, a number >= 0")
    out = []
    for i in range(samples):
        if i:
            sleep(cooldown_s)
        out.append(measure())
    return out


def time_verify(engine, k: int, repeats: int = 15) -> dict:
    """{"B,k+1": seconds} of a speculative verify call, forward_step over B rows x (k + 1) tokens (the last
    token and k proposals), at every decode batch bucket B (``_time_forward``: distinct blocks, median of
    ``repeats``). Compiles one forward_step shape per B that the serving engine does not otherwise compile."""
    return {f"{B},{k + 1}": _time_forward(engine, B, k + 1, repeats) for B in engine.decode_buckets}


WARMED_CALLS = 1   # untimed runs per call in a sample of an engine already warmed up (take_profile)


def _measure_points(engine, repeats: int, spec_tokens: int = 0, warm: bool = True, warm_calls: int = 3,
                    progress=None) -> dict:
    """One sample: time_engine's points (``warm_calls`` untimed runs per call) with the wake-up cost and the
    calibration of real steps (its warm-up run when ``warm``), and the verify calls of spec_tokens proposals
    when > 0. progress: called with one line per phase and its seconds (None: quiet)."""
    t0 = time.perf_counter()
    points = time_engine(engine, repeats, warm=warm_calls)
    if spec_tokens:
        points["verify"] = time_verify(engine, spec_tokens, repeats)
    t1 = time.perf_counter()
    points["wake"], points["cold_window"] = measure_wake(engine)
    t2 = time.perf_counter()
    points["calibration"] = calibrate_steps(engine, fit_cost_model(points), warm)
    if progress:
        progress(f"profile sample: calls {t1 - t0:.0f} s, wake-up {t2 - t1:.0f} s, calibration "
                 f"{time.perf_counter() - t2:.0f} s")
    return points


def take_profile(run_dir: str, model, cfg, kv_dtype: str = "float32", quantize: str = "none",
                 repeats: int = 15, mesh=None, samples: int = 1, cooldown_s: float = 0.0,
                 spec_tokens: int = 0, progress=None) -> dict:
    """Profile the model's engine at serve's default block size (16, or the key group G with per-channel int8
    keys: ``step_plan.default_block_size``; decode buckets up to 16 rows, chunks up to 64 tokens),
    on ``mesh`` (a jax Mesh from ``dantinox.parallel.mesh.make_mesh``) when given, else on one device;
    ``samples`` independent samples ``cooldown_s`` seconds apart after a warm-up (see the module docstring),
    each call timed as the median of ``repeats`` runs; with ``spec_tokens`` k >= 1 also the speculative verify
    call at B x (k + 1) (``time_verify``). With samples > 1 the engine is warmed up first (every bucket compiled,
    one untimed pass over the calls), so each sample runs WARMED_CALLS untimed run per call, not 3. progress:
    called with one line per phase and its seconds (None: quiet). Returns the profile dict (JSON-ready): identity,
    machine, mesh, rates, points, cost model, samples, bottleneck rows. Raises ValueError for a kv_dtype /
    quantize this version cannot build or a bad samples / cooldown_s / spec_tokens, MeshError (a ValueError)
    when the model does not divide over the mesh."""
    repeat_samples(lambda: None, samples, cooldown_s, sleep=lambda _: None)   # check the arguments first
    check_spec_tokens("--spec-tokens", spec_tokens)
    model, cfg = apply_variant(model, cfg, kv_dtype, quantize)
    P = default_block_size(cfg)   # 16, or the key group of per-channel int8 keys (the int8 default)
    config = EngineConfig(block_size=P, max_running=16, max_batched_tokens=64, max_decode_steps=8)  # a full pool
    engine = PagedEngine(model, config) if mesh is None else ShardedPagedEngine(model, config, mesh)
    with mesh_scope(mesh):  # the engine's own steps enter it too; the direct calls below need it
        warm_calls = 3
        if samples > 1:
            t0 = time.perf_counter()
            compiled = engine.warmup()
            time_engine(engine, 1)   # untimed: the first runs after compiling are slow on a CPU
            warm_calls = WARMED_CALLS
            if progress:
                progress(f"profile warm-up: {compiled.compilations} compilations ({compiled.cache_hits} from the "
                         f"persistent cache) and one untimed pass, {time.perf_counter() - t0:.0f} s")
        index = iter(range(samples))   # the calibration's warm-up run in the first sample only (calibrate_steps)
        all_points = repeat_samples(lambda: _measure_points(engine, repeats, spec_tokens, next(index) == 0,
                                                            warm_calls, progress), samples, cooldown_s)
    rates = machine_rates()
    weights = param_bytes(model)
    n_params = param_bytes(dataclasses.replace(cfg, cache_dtype="float32")) // 4   # float32 build: 4 B each
    kv_bpt = kv_bytes_per_token(cfg)
    points = all_points[0]
    return {"format": PROFILE_FORMAT, "identity": model_identity(run_dir, cfg), "kv_dtype": kv_dtype,
            "quantize": quantize, "block_size": P,
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "device": str(jax.devices()[0].device_kind), "cpus": os.cpu_count(),
                        "devices": jax.device_count(),
                        "devices_used": 1 if mesh is None else int(mesh.devices.size)},
            "mesh": mesh_shape(mesh),
            "rates": rates, "points": points, "cost_model": fit_cost_model(points).to_dict(),
            "samples": [{"points": p, "cost_model": fit_cost_model(p).to_dict()} for p in all_points],
            "cooldown_s": float(cooldown_s), **({"spec_tokens": spec_tokens} if spec_tokens else {}),
            "bottleneck": bottleneck_rows(cfg, points, rates, weights, kv_bpt, n_params)}


def profile_cost_models(profile: dict, where: str = "--profile") -> list:
    """[CostModel, ...]: one per sample of a format-3 profile, the single one of a format-2 profile. Raises
    ValueError naming ``where`` and the field for a missing or malformed cost model."""
    try:
        if profile.get("format") == 2 or "samples" not in profile:
            return [CostModel.from_dict(profile["cost_model"])]
        if not isinstance(profile["samples"], list) or not profile["samples"]:
            raise ValueError("samples: a non-empty list is required")
        return [CostModel.from_dict(s["cost_model"]) for s in profile["samples"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def check_profile(profile: dict, identity: dict, where: str = "--profile") -> None:
    """Raise ValueError naming the first difference between the profile's identity and the model's: another
    format, dantinox version, weights digest or config field."""
    if profile.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{where}: profile format {profile.get('format')!r} is not allowed: this dantinox reads "
                         f"formats {READABLE_FORMATS}; take the profile again (dantinox plan profile)")
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
            hint = (f": plan with --max-context {theirs_value}, or profile with --max-context {value}"
                    if key == "max_context" else "")
            raise ValueError(f"{where}: the profile's model has {key}={theirs_value!r}, "
                             f"this model has {key}={value!r}{hint}")


def _config_default(key: str):
    """The ModelConfig default of field `key` (None for an unknown field). A profile written before a config
    field existed was taken on a model with that field at its default, which leaves the model unchanged."""
    for field in dataclasses.fields(ModelConfig):
        if field.name == key:
            return None if field.default is dataclasses.MISSING else field.default
    return None
