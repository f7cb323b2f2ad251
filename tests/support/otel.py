"""The OpenTelemetry SDK as a user sets it up, in this process, for the in-process
tracing tests: its in-memory span exporter and metric reader, set once a process
(OpenTelemetry's global providers can be set only once)."""

from __future__ import annotations

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class Exporter(InMemorySpanExporter):
    """The in-memory exporter, failing while ``failing`` is set (a collector down)."""

    failing = False

    def export(self, spans):
        if self.failing:
            raise OSError("collector unreachable")
        return super().export(spans)


EXPORTER = Exporter()
READER = InMemoryMetricReader()
_installed = False


def install() -> Exporter:
    """Set the SDK up (once), and return its exporter, emptied."""
    global _installed
    if not _installed:
        _installed = True
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))
    EXPORTER.clear()
    return EXPORTER
