#!/usr/bin/env python3
"""Generates the operator files that are derived from one source each:

- deploy/grafana/pagedserve-{prefill,decode,router}.json: one Grafana dashboard per
  pool, built from the panel lists below (every query names series that
  common/runtime/metrics.py or router/metrics.py exports; tests/test_deploy.py checks it
  against a real scrape);
- deploy/k8s/components/monitoring/prometheusrule.yaml: deploy/prometheus/alerts.yml
  wrapped in a PrometheusRule for the Prometheus operator.

    python deploy/generate.py           # (re)write them
    python deploy/generate.py --check   # exit 1 if a committed file differs

The outputs are committed (operators import them as they are); edit this script or
alerts.yml, never the outputs. Standard library + PyYAML only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = DEPLOY / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"
GRAFANA = DEPLOY / "grafana"
DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24  # Grafana's grid

# -- panels ------------------------------------------------------------------------------


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > WIDTH:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.add({"type": "row", "title": title, "collapsed": False, "panels": []}, WIDTH, 1)
        self.x, self.y, self.row_h = 0, self.y + 1, 0


def targets(queries: list[tuple[str, str]]) -> list[dict]:
    return [
        {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
        for i, (expr, legend) in enumerate(queries)
    ]


def timeseries(
    title: str,
    queries: list[tuple[str, str]],
    unit: str = "short",
    description: str = "",
    stacked: bool = False,
    max_value: float | None = None,
) -> dict:
    defaults: dict = {
        "unit": unit,
        "min": 0,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if stacked else 5,
            "showPoints": "never",
            "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
        },
    }
    if max_value is not None:
        defaults["max"] = max_value
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets(queries),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def ratio(title: str, queries: list[tuple[str, str]], description: str = "") -> dict:
    """A time series of fractions (0 to 1, shown as percent)."""
    return timeseries(title, queries, "percentunit", description, max_value=1)


def stat(
    title: str,
    expr: str,
    unit: str = "short",
    description: str = "",
    thresholds: list[tuple[float | None, str]] | None = None,
) -> dict:
    steps = [{"value": v, "color": c} for v, c in (thresholds or [(None, "green")])]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets([(expr, "")]),
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p95/p99 of a histogram over the dashboard's rate interval."""
    group = f"le, {by}" if by else "le"
    legend = f"p{{q}} {{{{{by}}}}}" if by else "p{q}"
    return [
        (
            f"histogram_quantile({q / 100}, sum by ({group}) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            legend.format(q=q),
        )
        for q in (50, 95, 99)
    ]


def variable_datasource() -> dict:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
    }


def variable_query(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": name},
        "refresh": 2,  # on time range change: workers come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {},
        "sort": 1,
        "hide": 0,
    }


def dashboard(uid: str, title: str, description: str, variables: list[dict], layout: Layout):
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pagedserve"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": ["pagedserve"],
                "title": "pagedserve",
                "asDropdown": True,
            }
        ],
        "templating": {"list": [variable_datasource(), *variables]},
        "panels": layout.panels,
    }


# -- the worker pools ----------------------------------------------------------------------


def pool_dashboard(pool: str) -> dict:
    """Prefill and decode workers export the same series; each pool's dashboard leads
    with what matters for it (prompt throughput and cache hits for prefill, generation
    throughput and batch size for decode).

    Table-driven: each row is a list of (width, height, panel), and the queries are
    built by the small helpers below (a per-worker rate, a per-worker gauge), so a
    panel is one entry, not a block of repeated code."""
    s = f'pool="{pool}", worker=~"$worker"'
    ri = "$__rate_interval"

    def series(metric: str) -> str:
        return f"pagedserve:{metric}{{{s}}}"

    def rate(metric: str) -> str:
        return f"rate({series(metric)}[{ri}])"

    def total(expr: str, by: str = "") -> str:
        return f"sum by ({by}) ({expr})" if by else f"sum({expr})"

    def per_worker(expr: str, legend: str = "") -> tuple[str, str]:
        return total(expr, "worker"), f"{legend} {{{{worker}}}}".lstrip()

    def worker_rates(**metrics: str) -> list[tuple[str, str]]:
        """One per-worker rate per {legend: metric}."""
        return [per_worker(rate(metric), legend) for legend, metric in metrics.items()]

    def worker_gauge(metric: str) -> tuple[str, str]:
        return series(metric), "{{worker}}"

    def share(numerator: str, denominator: str) -> tuple[str, str]:
        return f"{total(rate(numerator), 'worker')} / {total(rate(denominator), 'worker')}", (
            "{{worker}}"
        )

    red_above = [(None, "green"), (1, "red")]
    prompt = per_worker(rate("prompt_tokens_total"), "prompt")
    gen = per_worker(rate("generation_tokens_total"), "generated")
    computed = per_worker(rate("prompt_tokens_computed_total"), "computed")
    phases = [
        ("queue", "Arrival here to the first step (a decode worker's KV import included)."),
        ("prefill", "First step to the first token (requests prefilled here)."),
        ("decode", "First token to the last (requests decoded here)."),
        ("inference", "First step to the last token."),
    ]
    rows: list[tuple[str, list[tuple[int, int, dict]]]] = [
        (
            "Overview",
            [
                (4, 4, stat(
                    "Workers up",
                    f'count(pagedserve:engine_up{{pool="{pool}"}} == 1)',
                    description="Workers whose engine answered the last scrape.",
                    thresholds=[(None, "red"), (1, "green")],
                )),
                (4, 4, stat("Running sequences", total(series("num_requests_running")))),
                (4, 4, stat(
                    "Waiting sequences",
                    total(series("num_requests_waiting")),
                    thresholds=[(None, "green"), (1, "yellow")],
                )),
                (4, 4, stat(
                    "KV cache usage (max)",
                    f"max({series('kv_cache_usage_perc')})",
                    unit="percentunit",
                    thresholds=[(None, "green"), (0.8, "yellow"), (0.9, "red")],
                )),
                (4, 4, stat(
                    "Preemptions (1h)",
                    total(f"increase({series('num_preemptions_total')}[1h])"),
                    thresholds=red_above,
                )),
                (4, 4, stat(
                    "Expired KV leases (1h)",
                    total(f"increase({series('kv_leases_expired_total')}[1h])"),
                    thresholds=red_above,
                )),
            ],
        ),
        (
            "Throughput and load",
            [
                (12, 8, timeseries(
                    "Tokens / s",
                    [prompt, computed, gen] if pool == "prefill" else [gen, prompt, computed],
                    description="Prompt tokens of the requests prefilled here (prefix-cache "
                    "hits included, vLLM's prompt_tokens_total), of which computed, and "
                    "tokens generated.",
                )),
                (12, 8, timeseries(
                    "Sequences by state",
                    [
                        per_worker(series(f"num_requests_{state}"), state)
                        for state in ("running", "waiting", "swapped")
                    ],
                )),
            ],
        ),
        (
            "KV cache",
            [
                (8, 8, ratio(
                    "KV cache usage",
                    [worker_gauge("kv_cache_usage_perc")],
                    "Blocks held by sequences / all blocks (alert above 90%).",
                )),
                (8, 8, timeseries(
                    "Blocks",
                    [
                        (total(series("num_used_blocks")), "used"),
                        (total(series("num_cached_blocks")), "cached (evictable)"),
                        (total(series("num_free_blocks")), "free"),
                    ],
                    stacked=True,
                    description="Every block is exactly one of used, cached-and-free, free.",
                )),
                (8, 8, ratio(
                    "Prefix-cache hit rate",
                    [share("prefix_cache_hits_total", "prefix_cache_queries_total")],
                    "Prompt tokens found cached / prompt tokens looked up.",
                )),
                (12, 8, timeseries(
                    "Preemptions and evictions / s",
                    worker_rates(
                        preemptions="num_preemptions_total", evictions="prefix_cache_evictions_total"
                    ),
                    description="Preemptions: the pool is short of KV blocks. Evictions: "
                    "cached prefixes dropped (LRU) to make room.",
                )),
                (12, 8, timeseries("KV cache blocks (pool size)", [worker_gauge("num_blocks")])),
            ],
        ),
        (
            "Engine",
            [
                (8, 8, timeseries(
                    "Step time",
                    quantiles("pagedserve:engine_step_duration_seconds", s),
                    unit="s",
                    description="One engine step: schedule, model forward, sample.",
                )),
                (8, 8, timeseries("Steps / s", [per_worker(rate("engine_steps_total"))])),
                (8, 8, ratio(
                    "Model forward share of step time",
                    [share("engine_forward_seconds_total", "engine_step_duration_seconds_sum")],
                    "The rest is scheduling, sampling and bookkeeping overhead.",
                )),
                (24, 6, timeseries(
                    "Engine loop: seconds since the last step or idle tick",
                    [worker_gauge("engine_tick_age_seconds")],
                    unit="s",
                    description="Grows only while one step runs; above 60 s engine_up drops "
                    "to 0 (alerted).",
                )),
            ],
        ),
        (
            "Request phases",
            [
                (6, 8, timeseries(
                    f"{phase.capitalize()} time",
                    quantiles(f"pagedserve:request_{phase}_time_seconds", s),
                    unit="s",
                    description=what,
                ))
                for phase, what in phases
            ],
        ),
        (
            "KV transfer",
            [
                (6, 8, timeseries(
                    "KV pulled (bytes / s)",
                    [(total(rate("kv_transfer_bytes_total"), "transport"), "{{transport}}")],
                    unit="Bps",
                    description="KV payload pulled into this pool's workers, by transport.",
                )),
                (6, 8, timeseries(
                    "Pull time",
                    quantiles("pagedserve:kv_transfer_seconds", s, by="transport"),
                    unit="s",
                    description="One pull (shared memory or gRPC), successful or not.",
                )),
                (6, 8, timeseries(
                    "Blocks pulled vs reused / s",
                    [
                        (total(rate("kv_transfer_blocks_total"), "outcome"), "{{outcome}}"),
                        (total(rate("kv_transfer_pulls_total")), "pulls"),
                    ],
                    description="reused: blocks a lease offered that the worker held already "
                    "(its own prefix cache), so not pulled.",
                )),
                (6, 8, timeseries(
                    "Pull failures / s",
                    [
                        (total(rate("kv_transfer_failures_total"), "cause"), "{{cause}}"),
                        (
                            total(rate("kv_transfer_checksum_mismatches_total")),
                            "checksum mismatches",
                        ),
                    ],
                    description="A failed pull is recomputed here (or fails the request, by "
                    "policy).",
                )),
            ],
        ),
        (
            "KV transfer leases",
            [
                (8, 8, timeseries(
                    "Open leases",
                    [worker_gauge("kv_open_leases")],
                    description="Exported KV block sets waiting to be pulled.",
                )),
                (8, 8, timeseries(
                    "Expired leases / s",
                    [per_worker(rate("kv_leases_expired_total"))],
                    description="Exported KV nobody pulled in time: lost work (alerted).",
                )),
                (8, 8, timeseries(
                    "Staged / pinned in place KV bytes",
                    [
                        (series("kv_staged_bytes"), "staged {{worker}}"),
                        (series("kv_in_place_pinned_bytes"), "pinned {{worker}}"),
                    ],
                    unit="bytes",
                    description="staged: copies held by open leases; pinned: cache blocks "
                    "that open in-place leases keep from reuse (capped by "
                    "kv_max_in_place_bytes).",
                )),
                (24, 8, timeseries(
                    "Exports in place / staged at the pin cap / refused / staged privately / s",
                    worker_rates(
                        in_place="kv_exports_in_place_total",
                        capped="kv_exports_in_place_capped_total",
                        refused="kv_exports_refused_total",
                        private="kv_exports_private_total",
                    ),
                    description="in_place: read out of the cache, no copy; capped: staged "
                    "because in-place leases pinned kv_max_in_place_bytes; refused: a "
                    "staging cap was reached (RESOURCE_EXHAUSTED); private: /dev/shm was "
                    "full, the KV went over gRPC.",
                )),
            ],
        ),
    ]  # fmt: skip
    lay = Layout()
    for title, panels in rows:
        lay.row(title)
        for w, h, panel in panels:
            lay.add(panel, w, h)
    return dashboard(
        f"pagedserve-{pool}",
        f"pagedserve / {pool} pool",
        f"The {pool} workers of pagedserve (common/runtime/metrics.py).",
        [
            variable_query(
                "worker", "Worker", f'label_values(pagedserve:worker_info{{pool="{pool}"}}, worker)'
            )
        ],
        lay,
    )


# -- the router -------------------------------------------------------------------------------


def router_dashboard() -> dict:
    s = 'instance=~"$instance"'
    ri = "$__rate_interval"

    def rate(metric: str, extra: str = "", by: str = "") -> str:
        sel = f"{s}, {extra}" if extra else s
        grouping = f" by ({by})" if by else ""
        return f"sum{grouping} (rate({metric}{{{sel}}}[{ri}]))"

    failed = rate("pagedserve:router_requests_total", extra='code!="OK"')
    lookups = "pagedserve:router_prefix_index_lookups_total"
    hits = rate(lookups, extra='result="hit"') + " / " + rate(lookups, extra='result=~"hit|miss"')
    lay = Layout()
    lay.row("Overview")
    lay.add(
        stat(
            "Requests / s",
            rate("pagedserve:router_requests_received_total"),
            unit="reqps",
            description="Generate calls arriving.",
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Failed requests",
            failed + " / " + rate("pagedserve:router_requests_total"),
            unit="percentunit",
            thresholds=[(None, "green"), (0.01, "yellow"), (0.05, "red")],
        ),
        4,
        4,
    )
    lay.add(stat("In flight", f"sum(pagedserve:router_requests_inflight{{{s}}})"), 4, 4)
    lay.add(
        stat(
            "Queued",
            f"sum(pagedserve:router_requests_queued{{{s}}})",
            thresholds=[(None, "green"), (1, "yellow")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Live decode workers",
            f'min(sum by (instance) (pagedserve:router_live_workers{{{s}, pool=~"decode|colocated"}}))',
            thresholds=[(None, "red"), (1, "green")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Live prefill workers",
            f'min(sum by (instance) (pagedserve:router_live_workers{{{s}, pool="prefill"}}))',
            thresholds=[(None, "yellow"), (1, "green")],
        ),
        4,
        4,
    )

    lay.row("Requests")
    lay.add(
        timeseries(
            "Requests / s by status code",
            [(rate("pagedserve:router_requests_total", by="code"), "{{code}}")],
            unit="reqps",
            stacked=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Samples / s by finish reason",
            [
                (
                    rate("pagedserve:router_request_success_total", by="finished_reason"),
                    "{{finished_reason}}",
                )
            ],
            stacked=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Admission: in flight and queued vs limits",
            [
                (f"sum(pagedserve:router_requests_inflight{{{s}}})", "in flight"),
                (f"sum(pagedserve:router_requests_queued{{{s}}})", "queued"),
                (
                    f'sum(pagedserve:router_admission_limit{{{s}, kind="inflight"}})',
                    "max in flight",
                ),
                (f'sum(pagedserve:router_admission_limit{{{s}, kind="queued"}})', "max queued"),
                (rate("pagedserve:router_admission_rejections_total"), "rejected / s"),
            ],
            description="Beyond both limits requests are rejected with RESOURCE_EXHAUSTED.",
        ),
        8,
        8,
    )

    lay.row("Latency (as clients see it)")
    lay.add(
        timeseries(
            "Time to first token",
            quantiles("pagedserve:router_time_to_first_token_seconds", s),
            unit="s",
            description="Arrival at the router to the first token streamed.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Inter-token latency",
            quantiles("pagedserve:router_inter_token_latency_seconds", s),
            unit="s",
            description="Gap between consecutive streamed tokens of a sample.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "End-to-end latency",
            quantiles("pagedserve:router_e2e_request_latency_seconds", s),
            unit="s",
            description="Arrival to the end of the stream, successful requests.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Tokens / s",
            [
                (rate("pagedserve:router_prompt_tokens_total"), "prompt"),
                (rate("pagedserve:router_generation_tokens_total"), "generated"),
            ],
        ),
        24,
        8,
    )

    lay.row("Routing and prefix reuse")
    lay.add(
        timeseries(
            "Routing decisions / s",
            [(rate("pagedserve:router_routing_decisions_total", by="kind"), "{{kind}}")],
            stacked=True,
            description="prefill_decode: disaggregated; local_prefill_*: the decode worker "
            "computed the prompt (short, mostly cached, or no prefill worker answered); "
            "cross_worker_pull: a cached prefix was pulled from another worker.",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Prefix index hit rate",
            [
                (
                    hits,
                    "requests with a cached prefix somewhere",
                ),
                (
                    f"{rate('pagedserve:router_prefix_index_hit_blocks_total')} / "
                    f"{rate('pagedserve:router_prefix_index_query_blocks_total')}",
                    "prompt blocks held by the best holder",
                ),
            ],
            unit="percentunit",
            max_value=1,
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Prefix exports (cross-worker pulls) / s",
            [
                (rate("pagedserve:router_prefix_exports_total", by="outcome"), "{{outcome}}"),
                (rate("pagedserve:router_prefix_export_blocks_total"), "blocks"),
            ],
            description="missing: the index named a holder that had evicted the prefix.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Prefix index and registry health",
            [
                (f"min(pagedserve:router_prefix_index_up{{{s}}})", "index up"),
                (f"min(pagedserve:router_up{{{s}}})", "router loop up"),
                (rate("pagedserve:router_prefix_index_unavailable_total"), "index failures / s"),
                (
                    rate("pagedserve:router_worker_registry_unavailable_total"),
                    "registry failures / s",
                ),
                (
                    rate("pagedserve:router_prefix_index_lookups_total", extra='result="skipped"'),
                    "lookups skipped / s",
                ),
                (rate("pagedserve:router_prefix_index_busy_total"), "lookups busy / s"),
                (
                    rate("pagedserve:router_worker_registry_malformed_total"),
                    "registry entries malformed / s",
                ),
            ],
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Live workers by pool",
            [
                (
                    f"max by (pool) (pagedserve:router_live_workers{{{s}}})",
                    "{{pool}}",
                )
            ],
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Retries, refusals and released leases / s",
            [
                (rate("pagedserve:router_retries_total", by="pool"), "retries {{pool}}"),
                (rate("pagedserve:router_worker_refusals_total", by="pool"), "refused {{pool}}"),
                (rate("pagedserve:router_leases_released_total"), "leases released"),
                (rate("pagedserve:router_draining_refusals_total"), "refused while draining"),
                (rate("pagedserve:router_channels_closed_total"), "channels closed"),
            ],
            description="A retry follows an UNAVAILABLE worker, a refusal a full one "
            "(RESOURCE_EXHAUSTED); the router releases the leases of KV handles no decode "
            "worker consumed; a draining router refuses new calls.",
        ),
        24,
        8,
    )
    return dashboard(
        "pagedserve-router",
        "pagedserve / router",
        "The pagedserve routers (router/metrics.py).",
        [variable_query("instance", "Router", "label_values(pagedserve:router_up, instance)")],
        lay,
    )


# -- outputs ----------------------------------------------------------------------------------


def prometheus_rule() -> str:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "pagedserve",
            "labels": {"app.kubernetes.io/name": "pagedserve", "release": "prometheus"},
        },
        "spec": {"groups": groups},
    }
    header = "# GENERATED by deploy/generate.py from deploy/prometheus/alerts.yml: do not edit.\n"
    return header + yaml.safe_dump(rule, sort_keys=False, width=1000)


def outputs() -> dict[Path, str]:
    out = {PROMETHEUS_RULE: prometheus_rule()}
    for name, board in [
        ("prefill", pool_dashboard("prefill")),
        ("decode", pool_dashboard("decode")),
        ("router", router_dashboard()),
    ]:
        out[GRAFANA / f"pagedserve-{name}.json"] = json.dumps(board, indent=2) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if an output differs")
    args = p.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(DEPLOY.parent)}")
    if stale:
        names = ", ".join(str(p.relative_to(DEPLOY.parent)) for p in stale)
        print(f"stale generated files: {names} (run python deploy/generate.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
