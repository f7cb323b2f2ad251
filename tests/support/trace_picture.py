"""One trace drawn as a trace viewer shows it: a bar per span on a time axis, its
children beneath it, indented, its events as marks on its bar. Plain SVG text.

The tracing how-to's picture is drawn from the spans of a real worker by the test that
checks them (tests/celery/test_traces.py, with ``TRACE_PICTURE`` naming the file)."""

from __future__ import annotations

from html import escape
from pathlib import Path

from tests.support.spans import Span

ROW, LABEL, BAR, PAD = 26, 330, 560, 12
COLOURS = {
    "run/": "#6b8fd6",
    "apply_async/": "#9aa7bd",
    "exclusive.acquire": "#e0a040",
    "exclusive.wait": "#d46a6a",
    "exclusive.store": "#8cbf88",
}


def _colour(name: str) -> str:
    return next((c for prefix, c in COLOURS.items() if name.startswith(prefix)), "#b0b0b0")


def _rows(span: Span, depth: int = 0) -> list[tuple[Span, int]]:
    rows = [(span, depth)]
    for child in sorted(span.children, key=lambda c: c.start):
        rows += _rows(child, depth + 1)
    return rows


def draw(root: Span, path: Path) -> None:
    rows = _rows(root)
    start = min(span.start for span, _ in rows)
    end = max(span.end for span, _ in rows)
    scale = BAR / max(end - start, 1)
    width, height = LABEL + BAR + 2 * PAD + 150, ROW * (len(rows) + 1) + 2 * PAD
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{PAD}" y="{PAD + 12}" font-weight="bold">span</text>',
        f'<text x="{PAD + LABEL}" y="{PAD + 12}" font-weight="bold">'
        f"time ({(end - start) / 1e6:.0f} ms in all)</text>",
    ]
    for row, (span, depth) in enumerate(rows, start=1):
        y = PAD + row * ROW
        x = PAD + LABEL + (span.start - start) * scale
        bar = max((span.end - span.start) * scale, 2)
        millis = (span.end - span.start) / 1e6
        out.append(
            f'<text x="{PAD + depth * 14}" y="{y + 14}">{escape(span.name)}</text>'
            f'<rect x="{x:.1f}" y="{y + 3}" width="{bar:.1f}" height="{ROW - 8}" rx="2" '
            f'fill="{_colour(span.name)}"/>'
            f'<text x="{x + bar + 4:.1f}" y="{y + 14}" fill="#555">{millis:.1f} ms</text>'
        )
        for event in span.events:
            if not event["name"].startswith("exclusive."):
                continue
            at = PAD + LABEL + (event.get("time", span.end) - start) * scale
            out.append(
                f'<path d="M{at:.1f} {y + 1} l5 7 l-5 7 l-5 -7 z" fill="#333">'
                f"<title>{escape(event['name'])}</title></path>"
                f'<text x="{at + 7:.1f}" y="{y + 24}" font-size="10" fill="#333">'
                f"{escape(event['name'])}</text>"
            )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
