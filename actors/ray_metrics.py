"""An engine's Prometheus metrics in Ray's own metrics pipeline: what each
node's metrics agent serves on Ray's Prometheus endpoint (the one Ray's
dashboards and a cluster's Prometheus scrape), for engines that have no
HTTP `/metrics` of their own, such as a batch job's replicas.

Each sample of the engine's registry (frontend/metrics.py) is set on a Ray
gauge of the same name with `:` made `_` (Ray's metric names take letters,
digits and `_` only), its labels as tags plus `ReplicaId`; Ray's endpoint
adds its `ray_` prefix and its own tags (node, worker, session):
`rayvllm:generation_tokens_total` is served as
`ray_rayvllm_generation_tokens_total`.
Counters and histogram series arrive as gauges holding the running totals,
which PromQL's `rate()` and `histogram_quantile()` read as they read the
originals. `_created` timestamps are left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from ray.util.metrics import Gauge

_DISALLOWED = re.compile(r"[^a-zA-Z0-9_]")
REPLICA_TAG = "ReplicaId"


def ray_metric_name(name: str) -> str:
    """`name` as Ray accepts it."""
    return _DISALLOWED.sub("_", name)


class RayMetricsExporter:
    """Sets Ray gauges from an engine's metric families; one per replica.
    Invariant: one gauge per exported sample name, its tag keys fixed by the
    first sample seen (a sample name's labels never change)."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._gauges: dict[str, tuple[Gauge, tuple[str, ...]]] = {}

    def export(self, families: Iterable[Metric]) -> int:
        """Set every sample of `families`; returns how many were set."""
        count = 0
        for family in families:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                name = ray_metric_name(sample.name)
                entry = self._gauges.get(name)
                if entry is None:
                    keys = tuple(sorted(sample.labels)) + (REPLICA_TAG,)
                    entry = self._gauges[name] = (Gauge(name, family.documentation or name, tag_keys=keys), keys)
                gauge, keys = entry
                tags = {key: str(sample.labels.get(key, "")) for key in keys}
                tags[REPLICA_TAG] = self.replica_id
                gauge.set(float(sample.value), tags=tags)
                count += 1
        return count
