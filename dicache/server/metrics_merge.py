"""`merge_expositions`: the Prometheus text of several server processes as one exposition, a label per process.

Used by the Ray Serve deployment to answer `/metrics` for every replica at once (`ray.metrics`). Each family keeps
its name, type and help; every sample gains `replica="<id>"` (a label the sample already had under that name is
replaced). Families are listed in order of first appearance; a family's samples keep their process order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Families:
    """A collector yielding fixed, already built metric families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


def merge_expositions(texts: Mapping[str, str | bytes], label: str = REPLICA_LABEL) -> bytes:
    """`{process id: its text exposition}` -> one text exposition (bytes) with `label` set to the process id.

    Raises `ValueError` (from the parser) if a text is not a Prometheus text exposition, or if two processes give
    one family different types.
    """
    merged: dict[str, Metric] = {}
    for process, text in texts.items():
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif target.type != family.type:
                raise ValueError(
                    f"metric family {family.name!r} is a {target.type} in one process and a {family.type} in "
                    f"process {process!r}"
                )
            for sample in family.samples:
                target.add_sample(sample.name, {**sample.labels, label: str(process)}, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged.values()))
    return generate_latest(registry)
