"""Prometheus metrics of a server, in their own registry (several servers can live in one process).

Latencies are in seconds, measured by the engine thread: time to first token (TTFT) from the moment the
request was submitted, inter-token latency (ITL) between consecutive tokens of one request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# engine.stats() counters mirrored as Prometheus counters (increased by their change since the last update)
_COUNTERS = {"preemptions": "Sequences preempted (recompute or swap)",
             "prefix_cache_hits": "Prompt blocks served from the prefix cache",
             "prefix_cache_queries": "Prompt blocks looked up in the prefix cache",
             "generated_tokens": "Tokens generated",
             "computed_tokens": "Tokens fed through the model (prefill, re-prefill and decode)"}
# speculative decoding counters (engine.stats() keys, present with a proposer under "spec_proposer"), labelled
# by proposer: dantinox_spec_proposed_tokens_total{proposer="ngram"}, dantinox_spec_accepted_tokens_total
_SPEC_COUNTERS = {"spec_proposed_tokens": "Speculative tokens proposed and verified, by proposer",
                  "spec_accepted_tokens": "Speculative tokens accepted by the target, by proposer"}
# KV tiers (engine.stats()["kv_tiers"][tier], dantinox.kv.tiers), labelled by tier ("host", "disk")
_TIER_COUNTERS = {"hits": "Prefix blocks found in a KV tier, by tier",
                  "promotions": "Prefix blocks restored from a KV tier into the pool, by tier",
                  "stores": "Prefix blocks stored in a KV tier (evicted from the pool, or written through to disk)",
                  "evictions": "Prefix blocks a KV tier dropped at its bound (least recently used), by tier",
                  "refused": "Damaged block files refused and removed (disk tier)"}
_TIER_GAUGES = {"bytes": "Bytes a KV tier holds, by tier", "capacity_bytes": "A KV tier's bound in bytes, by tier",
                "blocks": "Prefix blocks a KV tier holds, by tier"}
_GAUGES = {"waiting": "Requests waiting in the queue", "running": "Sequences running (holding KV blocks)",
           "swapped": "Preempted sequences whose KV blocks wait in host memory",
           "blocks_used": "KV blocks in use", "blocks_free": "KV blocks free"}


class ServerMetrics:
    """TTFT / ITL histograms, queue and cache gauges, counters. ``render()`` gives the text exposition."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("dantinox_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("dantinox_inter_token_latency_seconds", "Time between consecutive tokens",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("dantinox_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejections = Counter("dantinox_requests_rejected", "Requests rejected at admission, by reason",
                                  ["reason"], registry=r)
        self.gauges = {k: Gauge(f"dantinox_{k}", text, registry=r) for k, text in _GAUGES.items()}
        self.counters = {k: Counter(f"dantinox_{k}", text, registry=r) for k, text in _COUNTERS.items()}
        self.spec = {k: Counter(f"dantinox_{k}", text, ["proposer"], registry=r) for k, text in _SPEC_COUNTERS.items()}
        self._last = {k: 0 for k in (*_COUNTERS, *_SPEC_COUNTERS)}
        self.tier_counters = {k: Counter(f"dantinox_kv_tier_{k}", text, ["tier"], registry=r)
                              for k, text in _TIER_COUNTERS.items()}
        self.tier_gauges = {k: Gauge(f"dantinox_kv_tier_{k}", text, ["tier"], registry=r)
                            for k, text in _TIER_GAUGES.items()}
        self._last_tier: dict = {}

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def finished(self, reason: str | None) -> None:
        self.requests.labels(finish_reason=reason or "unknown").inc()

    def rejected(self, err: Exception | None = None, reason: str | None = None) -> None:
        """Count one rejected request under one reason label: ``reason`` if given, else from ``err``:
        "queue_full" (QueueFullError, 429), "invalid_<field>" (a RequestError naming the JSON field, 400),
        or "invalid". The server passes "invalid_json" / "invalid_body" (a body that is not JSON or not an
        object), "invalid_<field>" (a missing field or a type error in one, 400) and "unavailable" (503)."""
        if reason is None:
            field = getattr(err, "field", None)
            field = field and field.split("[")[0].split(".")[0]  # messages[3].role -> messages: bounded labels
            reason = ("queue_full" if type(err).__name__ == "QueueFullError"
                      else f"invalid_{field}" if field else "invalid")
        self.rejections.labels(reason=reason).inc()

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            gauge.set(stats.get(key, 0))
        for key, counter in self.counters.items():
            value = stats.get(key, 0)
            if value > self._last[key]:
                counter.inc(value - self._last[key])
            self._last[key] = value
        proposer = stats.get("spec_proposer")
        for key, counter in self.spec.items():
            value = stats.get(key, 0)
            if proposer is not None and value > self._last[key]:
                counter.labels(proposer=proposer).inc(value - self._last[key])
            self._last[key] = value
        self._update_tiers(stats.get("kv_tiers") or {})

    def _update_tiers(self, tiers: dict) -> None:
        """Per-tier counters (increased by their change) and gauges of the KV tiers' stats."""
        for tier, values in tiers.items():
            for key, counter in self.tier_counters.items():
                value, last = values.get(key, 0), self._last_tier.get((tier, key), 0)
                if key in values and value > last:
                    counter.labels(tier=tier).inc(value - last)
                self._last_tier[(tier, key)] = value
            for key, gauge in self.tier_gauges.items():
                if key in values:
                    gauge.labels(tier=tier).set(values[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)
