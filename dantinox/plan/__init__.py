"""The capacity plan: traces, a profile of the engine's calls, a simulator over the serving scheduler, a replay
on the real engine, a sweep of candidate deployments behind SLOs and quality gates, and a release gate.

  trace.py         JSONL trace format and a seeded generator of mixed traces
  trace_import.py  Mooncake traces and serve --request-log files converted to the trace format
  profile.py       time the engine's compiled calls; machine rates; bottleneck rows     cost_model.py: the fit
  simulate.py      virtual clock over the real Scheduler / BlockAllocator / ContextPolicy, several replicas
  router.py        round robin, least outstanding tokens, prefix affinity
  replay.py        the same trace through the real engine, in process
  metrics.py       TTFT / TPOT / ITL percentiles, tokens/s, goodput, SLO attainment
  uncertainty.py   one simulation per profile sample: medians and t / range intervals
  load_sweep.py    the load sweep's knee, saturation point and goodput rate
  fidelity.py      simulated intervals against replays, cell by cell, and the fidelity verdict
  candidate.py     a deployment to sweep; ledger.py its memory; variants.py kv dtype / weight quantization
  quality_gate.py  dantinox eval --gate per model variant
  recommend.py     drop by memory, quality and SLO; cheapest survivor by cost per million tokens
  inputs.py        the plan's inputs read and checked: trace, SLOs, memory sizes, candidates, the model
  report.py        plan.md, plots, plan.json, serve.yaml
  release_gate.py  the release gate: a new plan against the last good one

``dantinox plan`` and its subcommands live in ``dantinox/cli/plan.py``, one whole plan run in
``dantinox/cli/plan_run.py``.
"""
