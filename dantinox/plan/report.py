"""Write a plan: plan.json, plan.md, the plots and the serve configuration, each to a temporary file renamed
into place (a reader never sees half a file).

plan.json is deterministic: keys sorted, floats from the simulation (rounded there), no timestamps; the same
inputs give the same bytes. plan.md holds the recommendation, the table of every candidate and why each was
dropped, each latency as the median over the profile samples with its interval, the SLO the decision used (the
interval's pessimistic edge unless --decide-at median), the candidates that pass only at the median, SLO
attainment and goodput per candidate, the load sweep with its knee, saturation and goodput rate, the memory
ledger and the bottleneck report. Plots (matplotlib, Agg backend, fixed metadata so the
PNG bytes do not carry a date): TTFT CDF per candidate with the SLO line; output tokens/s and p99 TTFT
against arrival rate; the memory ledger as a stacked bar; output tokens/s per user against per replica with
the Pareto front (pareto.py).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile

from ..runs.files import atomic_write_bytes
from .candidate import Candidate

PLOTS = ("ttft_cdf.png", "rate_sweep.png", "memory_ledger.png", "pareto.png")


def plan_json_bytes(plan: dict) -> bytes:
    """The canonical bytes of a plan (sorted keys, one-space indent, trailing newline)."""
    return (json.dumps(plan, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def serve_config(candidate: dict, run_dir: str | None) -> str:
    """The YAML that ``dantinox serve --config`` reads for one replica of ``candidate``."""
    flags = Candidate.from_dict(candidate).serve_flags()
    if run_dir:
        flags["run_dir"] = run_dir
    if candidate.get("kv_dtype", "float32") != "float32":
        flags["kv_dtype"] = candidate["kv_dtype"]
    if candidate.get("quantize", "none") != "none":
        flags["quantize"] = candidate["quantize"]
    lines = [f"# dantinox serve --config: candidate {candidate['name']!r}, one of {candidate['replicas']} "
             f"replica(s) routed by {candidate['routing']}"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in sorted(flags.items())]
    return "\n".join(lines) + "\n"


def _fmt_ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f}"


def plan_markdown(plan: dict, plots_dir: str = ".") -> str:
    """plan.md text."""
    rec, slo = plan["recommendation"], plan["inputs"]["slo"]
    out = ["# Capacity plan", ""]
    row = next((r for r in plan["candidates"] if r["candidate"]["name"] == rec["name"]), None)
    if rec["fallback"]:
        where = " on the real engine" if rec.get("confirmed") is False else ""
        out += [f"**No candidate passed{where}.** Recommended fallback: **{rec['name']}** ({rec['reason']}).", ""]
    else:
        cost, m, iv = row["cost_per_million_usd"], row["metrics"], row.get("intervals") or {}
        word = "Recommended and confirmed on the real engine" if rec.get("confirmed") else "Recommended"
        out += [f"**{word}: {rec['name']}** ({rec['reason']}): {m['output_tokens_per_s']:.1f} output tokens/s, "
                f"p99 TTFT {_fmt_ms(m['ttft']['p99'])}{_interval_ms(iv.get('ttft_p99'))} ms, p99 TPOT "
                f"{_fmt_ms(m['tpot']['p99'])}{_interval_ms(iv.get('tpot_p99'))} ms, **${cost:.4f} per million output "
                f"tokens** at ${plan['inputs']['price_per_hour']}/h per replica.", ""]
    out += [f"SLO: p99 TTFT <= {_fmt_ms(slo.get('ttft_p99'))} ms, p99 TPOT <= {_fmt_ms(slo.get('tpot_p99'))} ms. "
            f"Device memory {_mib(plan['inputs']['device_bytes'])} MiB per replica. Trace: "
            f"{plan['inputs']['trace_requests']} requests (sha256 {plan['inputs']['trace_sha256'][:12]}). Model "
            f"weights sha256 {plan['identity']['weights_sha256'][:12]}, "
            f"dantinox {plan['identity']['dantinox_version']}.",
            "", uncertainty_line(plan), "", "## Candidates", "",
            "| candidate | kv | weights | P | run | chunk | steps | preempt | replicas | routing | tok/s | "
            "TTFT p50 / p99 ms [interval] | TPOT p99 ms [interval] | SLO attained TTFT / TPOT / all | goodput req/s"
            " | preempt | prefix hits | $/M tok | verdict |",
            "|---" * 19 + "|"]
    for r in plan["candidates"]:
        out.append(_candidate_line(r))
    only = [r["candidate"]["name"] for r in plan["candidates"] if r.get("passes_only_at_median")]
    out += ["", "Pass only at the median (dropped at the interval's pessimistic edge): "
            + (", ".join(only) if only else "none") + "."]
    out += confirmation_markdown(plan.get("confirmation"))
    out += ["", "## Memory ledger (per replica, MiB)", "",
            "| candidate | weights | KV pool (blocks) | reserve | total | device | fits |", "|---" * 7 + "|"]
    for r in plan["candidates"]:
        g = r["ledger"]
        out.append(f"| {r['candidate']['name']} | {_mib(g['weights'])} | {_mib(g['kv'])} ({g['kv_blocks']}) | "
                   f"{_mib(g['reserve'])} | {_mib(g['total'])} | {_mib(g['device'])} | "
                   f"{'yes' if g['fits'] else 'NO'} |")
    out += ["", "## Load sweep (recommended deployment)", "",
            "| rate (req/s) | output tok/s | p99 TTFT ms (median / high edge) | SLO attained (all) |",
            "|---|---|---|---|"]
    out += [f"| {s['rate_rps']} | {s['output_tokens_per_s']:.1f} | {_fmt_ms(s['ttft_p99_s'])} / "
            f"{_fmt_ms(s.get('ttft_p99_high_s'))} | {_pct(s.get('attainment_all'))} |" for s in plan["rate_sweep"]]
    out += ["", landmarks_line(plan.get("load_sweep")), "", pareto_line(plan.get("pareto"))]
    out += ["", "## Bottleneck report (profile)", ""] + bottleneck_markdown(plan.get("bottleneck", []),
                                                                            plan.get("rates", {}))
    out += ["", "## Quality gates", ""]
    out += [f"- kv {g['variant'][0]}, weights {g['variant'][1]}: "
            f"{ {True: 'pass', False: 'FAIL', None: 'not measured'}[g['passed']] } {g['detail']} "
            f"{'; '.join(g['failed'])}" for g in plan.get("gates", [])]
    out += ["", "## Plots", ""] + [f"![{p}]({os.path.join(plots_dir, p)})" for p in PLOTS]
    return "\n".join(out) + "\n"


def confirmation_markdown(conf: dict | None) -> list[str]:
    """plan.md's section on the replays of ``plan --confirm`` (nothing when the plan was not confirmed)."""
    if not conf:
        return []
    out = ["", "## Confirmation on the real engine", "",
           f"Each candidate replayed {conf['repeats']} times on the engine (trace arrivals on the wall clock, cold "
           "prefix cache); measured values are the median over the replays with their interval; a candidate is "
           "confirmed when every SLO holds at the measured interval's high edge. Predicted: the simulation "
           "(median [high edge])." + (f" {conf['warning']}." if conf.get("warning") else ""), "",
           "| candidate | role | TTFT p99 ms predicted | TTFT p50 / p99 ms measured [interval] | TPOT p99 ms "
           "predicted | TPOT p50 / p99 ms measured [interval] | confirmed |", "|---" * 7 + "|"]
    for r in conf["results"]:
        p, m = r["predicted"], r["measured"]
        mm, iv = m["metrics"], m["intervals"]
        verdict = "yes" if m["confirmed"] else "no: " + "; ".join(m["failures"])
        out.append(f"| {r['name']} | {r['role']} | {_fmt_ms(p['ttft_p99']['median'])} "
                   f"[{_fmt_ms(p['ttft_p99']['high'])}] | {_fmt_ms(mm['ttft']['p50'])} / {_fmt_ms(mm['ttft']['p99'])}"
                   f"{_interval_ms(iv.get('ttft_p99'))} | {_fmt_ms(p['tpot_p99']['median'])} "
                   f"[{_fmt_ms(p['tpot_p99']['high'])}] | {_fmt_ms(mm['tpot']['p50'])} / {_fmt_ms(mm['tpot']['p99'])}"
                   f"{_interval_ms(iv.get('tpot_p99'))} | {verdict} |")
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _rps(x) -> str:
    return "none in the sweep" if x is None else f"{x:g} req/s"


def uncertainty_line(plan: dict) -> str:
    """How latencies are stated and which value the SLO check used."""
    u = plan.get("uncertainty") or {}
    samples = ", ".join(f"{k}: {v}" for k, v in sorted((u.get("samples") or {}).items()))
    method = {"t": f"a t-based {u.get('confidence', 0.9):.0%} interval of the mean over the samples' simulations "
                   "(mean +- t x s / sqrt(K))", "range": "the range (min-max) over the samples' simulations",
              None: "point estimates (one profile sample: no interval)"}.get(u.get("interval"), "-")
    at = "the interval's pessimistic (high) edge" if u.get("decide_at", "edge") == "edge" else "the median"
    return (f"Latency: median over one simulation per profile sample ({samples or '-'}), with {method}. SLO "
            f"decisions use {at}.")


def landmarks_line(marks: dict | None) -> str:
    """The load sweep's knee, saturation and goodput rate in words."""
    if not marks:
        return "(no load sweep)"
    return (f"Knee (Kneedle on p99 TTFT): {_rps(marks['knee_rps'])}; saturation (output tokens/s per request/s "
            f"below 95 % of the lightest rate's): {_rps(marks['saturation_rps'])}; goodput (highest rate with "
            f">= {marks['attainment_target']:.0%} of requests meeting every SLO, DistServe): "
            f"{_rps(marks['goodput_rps'])}.")


def pareto_line(pareto: dict | None) -> str:
    """The Pareto front of output tokens/s per user against per replica, in words."""
    if not pareto or not pareto["points"]:
        return "(no Pareto front: no candidate with a simulated TPOT)"
    by_name = {p["name"]: p for p in pareto["points"]}
    front = ", ".join(f"{n} ({by_name[n]['per_user']:.0f} / {by_name[n]['per_replica']:.0f})" for n in pareto["front"])
    return (f"Pareto front (output tokens/s per user = 1 / median TPOT, against output tokens/s per replica; "
            f"pareto.png): {front}.")


def _interval_ms(iv: dict | None) -> str:
    if not iv or iv.get("low") is None or iv["low"] == iv["high"]:
        return ""
    return f" [{_fmt_ms(iv['low'])}-{_fmt_ms(iv['high'])}]"


def _candidate_line(r: dict) -> str:
    c, m = r["candidate"], r["metrics"]
    verdict = "pass" if not r["dropped"] else "dropped: " + "; ".join(r["dropped"])
    if r["notes"]:
        verdict += " (" + "; ".join(r["notes"]) + ")"
    head = (f"| {c['name']} | {c['kv_dtype']} | {c['quantize']} | {c['block_size']} | {c['max_running']} | "
            f"{c['max_batched_tokens']} | {c['max_decode_steps']} | {c['preemption']} | {c['replicas']} | "
            f"{c['routing']} |")
    if m is None:
        return head + " - | - | - | - | - | - | - | - | " + verdict + " |"
    cost, iv, att = r["cost_per_million_usd"], r.get("intervals") or {}, m.get("slo_attainment") or {}
    return head + (f" {m['output_tokens_per_s']:.1f} | {_fmt_ms(m['ttft']['p50'])} / {_fmt_ms(m['ttft']['p99'])}"
                   f"{_interval_ms(iv.get('ttft_p99'))} | {_fmt_ms(m['tpot']['p99'])}{_interval_ms(iv.get('tpot_p99'))}"
                   f" | {_pct(att.get('ttft'))} / {_pct(att.get('tpot'))} / {_pct(att.get('all'))} | "
                   f"{m['goodput_rps']:.2f} | {m['preemptions']} | {m['prefix_cache_hits']} | "
                   f"{'-' if cost is None else f'{cost:.4f}'} | {verdict} |")


def bottleneck_markdown(rows: list, rates: dict) -> list[str]:
    """The bottleneck table: per call, measured time against bytes / bandwidth and FLOPs / matmul rate."""
    if not rows:
        return ["(no profile rows)"]
    out = [f"Machine: {rates.get('bandwidth_bytes_per_s', 0) / 1e9:.1f} GB/s streaming, "
           f"{rates.get('matmul_flops_per_s', 0) / 1e9:.1f} GFLOP/s float32 matmul (measured).", "",
           "| call | shape | measured ms | bytes / bandwidth ms | FLOPs / rate ms | bound | of bound |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['call']} | {r['shape']} | {r['measured_s'] * 1e3:.3f} | {r['memory_s'] * 1e3:.3f} | "
                   f"{r['compute_s'] * 1e3:.3f} | {r['bound']} | {r['efficiency']:.0%} |")
    return out


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, metadata={"Software": None})
    return buf.getvalue()


def plot_files(plan: dict, ttfts: dict) -> dict:
    """{file name: PNG bytes} of the four plots. ttfts: {candidate name: sorted TTFTs in seconds}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, values in ttfts.items():
        if values:
            ax.step([v * 1e3 for v in values], [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=name, linewidth=1)
    slo = plan["inputs"]["slo"].get("ttft_p99")
    if slo:
        ax.axvline(slo * 1e3, color="k", linestyle="--", label="SLO p99 TTFT")
        ax.axhline(0.99, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF per candidate")
    ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    files["ttft_cdf.png"] = _png(fig)
    plt.close(fig)
    files["rate_sweep.png"] = _rate_plot(plt, plan)
    files["memory_ledger.png"] = _ledger_plot(plt, plan)
    files["pareto.png"] = _pareto_plot(plt, plan)
    return files


def _rate_plot(plt, plan: dict) -> bytes:
    sweep = plan["rate_sweep"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rates = [s["rate_rps"] for s in sweep]
    line1 = ax.plot(rates, [s["output_tokens_per_s"] for s in sweep], "o-", label="output tokens/s")
    ax.set(xlabel="arrival rate (requests/s)", ylabel="output tokens/s",
           title=f"{plan['recommendation']['name']}: throughput and p99 TTFT vs load")
    ax2 = ax.twinx()
    line2 = ax2.plot(rates, [(s["ttft_p99_s"] or 0) * 1e3 for s in sweep], "s--", color="C3", label="p99 TTFT")
    ax2.set_ylabel("p99 TTFT (ms)")
    ax2.set_yscale("log")
    slo = plan["inputs"]["slo"].get("ttft_p99")
    if slo:
        ax2.axhline(slo * 1e3, color="k", linestyle=":", linewidth=0.8, label="SLO p99 TTFT")
    ax.legend(line1 + line2, [h.get_label() for h in line1 + line2], loc="upper left", fontsize=7)
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return data


def _pareto_plot(plt, plan: dict) -> bytes:
    pareto = plan.get("pareto") or {"points": [], "front": [], "sweep": []}
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for passed, marker, label in ((True, "o", "passed"), (False, "x", "dropped")):
        pts = [p for p in pareto["points"] if p["passed"] == passed]
        ax.scatter([p["per_replica"] for p in pts], [p["per_user"] for p in pts], marker=marker, label=label, s=18)
    by_name = {p["name"]: p for p in pareto["points"]}
    front = [by_name[n] for n in pareto["front"]]
    ax.plot([p["per_replica"] for p in front], [p["per_user"] for p in front], "k-", linewidth=0.8,
            label="Pareto front")
    for p in front:
        ax.annotate(p["name"], (p["per_replica"], p["per_user"]), fontsize=5, xytext=(2, 2),
                    textcoords="offset points")
    if pareto["sweep"]:
        ax.plot([p["per_replica"] for p in pareto["sweep"]], [p["per_user"] for p in pareto["sweep"]], "s:",
                color="C3", markersize=3, label=f"{plan['recommendation']['name']} across the load sweep")
    ax.set(xlabel="output tokens/s per replica", ylabel="output tokens/s per user (1 / median TPOT)",
           title="Throughput per user against per replica")
    ax.legend(fontsize=6)
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return data


def _ledger_plot(plt, plan: dict) -> bytes:
    rows = plan["candidates"]
    names = [r["candidate"]["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    bottom = [0.0] * len(rows)
    for part in ("weights", "kv", "reserve"):
        values = [r["ledger"][part] / 2**20 for r in rows]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(plan["inputs"]["device_bytes"] / 2**20, color="k", linestyle="--", label="device memory")
    ax.set(ylabel="MiB per replica", title="Memory ledger")
    ax.tick_params(axis="x", labelrotation=60, labelsize=6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return data


def write_plan(out_dir: str, plan: dict, ttfts: dict, run_dir: str | None) -> list[str]:
    """Write plan.json, plan.md, the plots and serve.yaml under out_dir. Returns the paths.

    Everything is rendered first. A new out_dir is written as a temporary directory beside it that becomes
    out_dir by one rename; an existing one (``--force``) has each file replaced atomically
    (``dantinox.runs.files.atomic_write_bytes``). A Ctrl-C while the plots render or the files are written
    leaves no out_dir and no half-written file.
    """
    files = {"plan.json": plan_json_bytes(plan), "plan.md": plan_markdown(plan).encode(),
             "serve.yaml": serve_config(plan["recommendation"]["candidate"], run_dir).encode()}
    files.update(plot_files(plan, ttfts))
    out_dir = os.path.abspath(out_dir)
    if os.path.isdir(out_dir):
        for name, data in files.items():
            atomic_write_bytes(os.path.join(out_dir, name), data)
        return [os.path.join(out_dir, name) for name in files]
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=os.path.dirname(out_dir))
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would become out_dir's mode
        for name, data in files.items():
            atomic_write_bytes(os.path.join(staging, name), data)
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after the rename
    return [os.path.join(out_dir, name) for name in files]
