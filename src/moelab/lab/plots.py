"""The lab's one plot stack: SVG written as text, for the site's pages and the report's figures.

Two kinds of output share the drawing (a plot area's scales, ticks, lines, bands):

- `svg_curves`: the site's plot, an <svg> sized by the page's CSS (viewBox only), followed by its legend as an
  HTML paragraph, which wraps at phone width;
- `line_plot`, `forecast_plot`, `mixture_plot`, `router_load_heatmap`: the report's figures, each a standalone
  SVG document (xmlns, width and height, a white ground, fonts and legend inside). The report writes one as a
  .svg file beside report.md and puts the same text inline in report.html.

Nothing here draws with a script, names an id (figures inline on one page would share the id namespace) or
loads a font or style from a network, and nothing needs matplotlib: a site rebuilt at every eval and a report
written at export both stay cheap.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import numpy as np

from moelab.lab.view import series

__all__ = ["svg_curves", "line_plot", "curve_ylim", "forecast_plot", "mixture_plot", "router_load_heatmap"]

_COLOURS = ("#1f5fa8", "#c2571a", "#2b8a3e", "#8e3ea8", "#9a7b00", "#555555", "#17808a", "#b8336a", "#6b4f2a",
            "#7f8c9a")  # ten, so the report's eight norm groups get a colour each
_BAND = "#2b8a3e"  # the report's predicted band and line, in no series' colour on their plots


# ----------------------------------------------------------------------------------------------
# the drawing both outputs share


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round values (1, 2, 2.5 or 5 times a power of ten apart) between lo and hi."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2 and 5 times the powers of ten between lo > 0 and hi; the powers alone when those are too many; the
    linear ticks when the range holds fewer than two of them."""
    marks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5)]
    marks = [v for v in marks if lo <= v <= hi]
    if len(marks) > 8:
        marks = [v for v in marks if f"{v:.0e}".startswith("1")]
    return marks if len(marks) >= 2 else _ticks(lo, hi)


@dataclass(frozen=True)
class _Frame:
    """A plot area, [left, right] x [top, bottom] in pixels, showing steps [x0, x1] and values [y0, y1] (on a
    log scale with `log_y`). A value outside [y0, y1] is drawn at the edge: a clipped band, never a lost line."""

    left: int
    top: int
    right: int
    bottom: int
    x0: float
    x1: float
    y0: float
    y1: float
    log_y: bool = False

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def py(self, y: float) -> float:
        y = min(max(y, self.y0), self.y1)
        lo, hi = self.y0, self.y1
        if self.log_y:
            y, lo, hi = math.log10(y), math.log10(lo), math.log10(hi)
        return self.bottom - (y - lo) / (hi - lo) * (self.bottom - self.top)

    def shows(self, y: float) -> bool:
        """Whether `y` has a place on the scale (a log scale has none for 0 or a negative value)."""
        return math.isfinite(y) and (y > 0 or not self.log_y)


def _axes(f: _Frame) -> list[str]:
    """The plot area's border, a grid line and label at each value tick, the step ticks and 'step' below."""
    out = [f'<rect x="{f.left}" y="{f.top}" width="{f.right - f.left}" height="{f.bottom - f.top}" '
           'fill="none" stroke="#bbb"/>']
    for v in _log_ticks(f.y0, f.y1) if f.log_y else _ticks(f.y0, f.y1):
        out.append(f'<line x1="{f.left}" x2="{f.right}" y1="{f.py(v):.1f}" y2="{f.py(v):.1f}" stroke="#eee"/>'
                   f'<text x="{f.left - 4}" y="{f.py(v) + 4:.1f}" text-anchor="end">{v:.4g}</text>')
    for v in _ticks(f.x0, f.x1):
        out.append(f'<text x="{f.px(v):.1f}" y="{f.bottom + 16}" text-anchor="middle">{v:.4g}</text>')
    out.append(f'<text x="{f.right}" y="{f.bottom + 30}" text-anchor="end">step</text>')
    return out


def _line(f: _Frame, steps: list, values: list, colour: str, label: str, dots: bool, dash: str | None = None
          ) -> list[str]:
    """A polyline through the values it can show; with `dots`, a dot at each too (one point draws no line)."""
    shown = [(x, y) for x, y in zip(steps, values) if f.shows(y)]
    points = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in shown)
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    out = [f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.8"{dashed}>'
           f'<title>{html.escape(label)}</title></polyline>']
    if dots:
        out += [f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in shown]
    return out


def _band(f: _Frame, steps: list, lo: list, hi: list, colour: str, opacity: float, label: str) -> str:
    upper = [f"{f.px(x):.1f},{f.py(h):.1f}" for x, h in zip(steps, hi)]
    lower = [f"{f.px(x):.1f},{f.py(v):.1f}" for x, v in zip(steps, lo)]
    return (f'<polygon points="{" ".join(upper + lower[::-1])}" fill="{colour}" fill-opacity="{opacity}">'
            f'<title>{html.escape(label)}</title></polygon>')


def _hline(f: _Frame, value: float, label: str, colour: str) -> str:
    return (f'<line x1="{f.left}" x2="{f.right}" y1="{f.py(value):.1f}" y2="{f.py(value):.1f}" '
            f'stroke="{colour}" stroke-dasharray="5 4"><title>{html.escape(label)}: {value:.4g}</title></line>')


# ----------------------------------------------------------------------------------------------
# the site: inline SVG, its legend in HTML


def svg_curves(series: dict[str, tuple[list[float], list[float]]], title: str,
               band: tuple[list[float], list[float], list[float]] | None = None,
               hlines: dict[str, float] | None = None, width: int = 640, height: int = 300) -> str:
    """Line plots of `series` ({label: (steps, values)}) with an optional shaded band (steps, lo, hi) and
    labelled horizontal lines, as one inline <svg> that scales to its container (viewBox)."""
    xs = [x for s, _ in series.values() for x in s] + (list(band[0]) if band else [])
    finite = [v for _, vs in series.values() for v in vs if math.isfinite(v)]
    finite += list((hlines or {}).values())
    if band:
        finite += [v for v in (*band[1], *band[2]) if math.isfinite(v)]
    if not xs or not finite:
        return f'<p class="note">{html.escape(title)}: nothing logged yet.</p>'
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    core = [v for _, vs in series.values() for v in vs if math.isfinite(v)] or finite
    y0, y1 = min(finite), max(finite)
    if y1 - y0 > 4 * (max(core) - min(core) + 1e-9):  # a huge step-0 loss or band must not flatten the curves
        y0, y1 = min(y0, min(core)), max(core) + 0.5 * (max(core) - min(core) + 1e-9)
    span = max(y1 - y0, 0.02 * abs(y1) + 1e-3)  # one point, or a flat curve: still a readable range around it
    y0, y1 = (y0 + y1 - span) / 2 - 0.05 * span, (y0 + y1 + span) / 2 + 0.05 * span
    f = _Frame(56, 28, width - 12, height - 34, x0, x1, y0, y1)
    out = [f'<svg class="plot" viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{html.escape(title)}</title>',
           f'<text x="{f.left}" y="16" class="t">{html.escape(title)}</text>', *_axes(f)]
    if band:
        out.append(_band(f, *band, _COLOURS[0], 0.15, "predicted 95% band"))
    off = {k: v for k, v in (hlines or {}).items() if not y0 <= v <= y1}  # named in the legend, not drawn
    hlines = {k: v for k, v in (hlines or {}).items() if k not in off}
    out += [_hline(f, value, label, "#b00") for label, value in hlines.items()]
    legend = []
    for i, (label, (steps, values)) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        out += _line(f, steps, values, colour, label, dots=len(steps) <= 40)  # a few evals (or one): dots too
        legend.append(f'<span style="color:{colour}">&#9632;</span> {html.escape(label)}')
    if band:
        legend.append(f'<span style="color:{_COLOURS[0]};opacity:.35">&#9632;</span> predicted 95% band')
    legend += [f'<span style="color:#b00">- -</span> {html.escape(label)}' for label in hlines]
    legend += [f"{html.escape(label)} {v:.4g} ({'above' if v > y1 else 'below'} the plot)" for label, v in off.items()]
    out.append("</svg>")
    return "".join(out) + f'<p class="legend">{" &nbsp; ".join(legend)}</p>'  # HTML: it wraps at phone width


# ----------------------------------------------------------------------------------------------
# the report: standalone SVG documents

# A figure is 960 units wide, the report page's widest column, so it is shown at its own size there: 13 px
# text, like the old PNGs' 9-10 pt at 110 dpi; narrower screens scale the whole figure down.
_WIDTH, _FONT, _TITLE_FONT, _ROW = 960, 13, 15, 20
_PLOT = dict(left=72, top=36, right=_WIDTH - 16, bottom=366)  # room for value labels, the y label and the title


def _document(title: str, width: int, height: int, body: list[str]) -> str:
    """An SVG file that renders on its own (xmlns, size, fonts, a white ground for dark viewers) and inline."""
    t = html.escape(title)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="system-ui,sans-serif" font-size="{_FONT}" role="img" '
            f'aria-label="{t}"><title>{t}</title><rect width="{width}" height="{height}" fill="#fff"/>'
            f'<text x="{width / 2:g}" y="22" text-anchor="middle" font-size="{_TITLE_FONT}" font-weight="bold">{t}'
            f'</text>{"".join(body)}</svg>')


def _ylabel(f: _Frame, text: str) -> str:
    return (f'<text transform="translate(18 {(f.top + f.bottom) / 2:g}) rotate(-90)" text-anchor="middle">'
            f"{html.escape(text)}</text>")


def _legend(items: list[tuple[str, str, str]], left: int, right: int, top: int) -> tuple[list[str], int]:
    """Legend entries (label, colour, swatch: "line", "dash" or an area's opacity) in rows from (left, top),
    wrapped before `right`; returns the elements and the y below the last row."""
    out, x, y = [], left, top
    for label, colour, swatch in items:
        width = 30 + 0.6 * _FONT * len(label) + 18  # swatch, gap, the label at an average glyph width
        if x > left and x + width > right:
            x, y = left, y + _ROW
        if swatch in ("line", "dash"):
            dash = ' stroke-dasharray="6 4"' if swatch == "dash" else ""
            out.append(f'<line x1="{x}" x2="{x + 24}" y1="{y - 4}" y2="{y - 4}" stroke="{colour}" stroke-width="1.8"'
                       f"{dash}/>")
        else:
            out.append(f'<rect x="{x}" y="{y - 11}" width="24" height="12" fill="{colour}" fill-opacity="{swatch}"/>')
        out.append(f'<text x="{x + 30}" y="{y}">{html.escape(label)}</text>')
        x += round(width)
    return out, y + 10


def _figure(title: str, f: _Frame, ylabel: str, body: list[str], items: list[tuple[str, str, str]]) -> str:
    """A plot area with its axes, `body` drawn in it, and the legend below: one standalone SVG."""
    legend, height = _legend(items, f.left, f.right, f.bottom + 52)
    return _document(title, _WIDTH, height, [*_axes(f), _ylabel(f, ylabel), *body, *legend])


def _padded(values: list[float]) -> tuple[float, float] | None:
    """The range of the finite values, 5% padded; None without one. One point or a flat line gets a range of 2%
    of its value around it, so its tick labels still differ."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    lo, hi = min(values), max(values)
    span = max(hi - lo, 0.02 * max(abs(lo), abs(hi)) + 1e-3)
    mid = (lo + hi) / 2
    return mid - 0.55 * span, mid + 0.55 * span


def curve_ylim(series: dict[str, tuple[list, list]]) -> tuple[float, float] | None:
    """The y-range of the lines alone, 5% padded; None without a finite value."""
    return _padded([float(v) for _, ys in series.values() for v in ys])


def _log_ylim(series: dict[str, tuple[list, list]]) -> tuple[float, float] | None:
    """The lines' positive range, padded by 5% of its decades each way; None without a positive value."""
    values = [float(v) for _, ys in series.values() for v in ys if math.isfinite(v) and v > 0]
    if not values:
        return None
    lo, hi = min(values), max(values)
    pad = (hi / lo) ** 0.05 if hi > lo else 2.0
    return lo / pad, hi * pad


def _frame(steps: list, limits: tuple[float, float] | None, log_y: bool = False) -> _Frame:
    """The report's plot area over `steps` and `limits` (an empty plot without them)."""
    x0, x1 = (min(steps), max(steps)) if steps else (0, 1)
    y0, y1 = limits or ((1.0, 10.0) if log_y else (0.0, 1.0))
    return _Frame(**_PLOT, x0=x0, x1=x1 if x1 > x0 else x0 + 1, y0=y0, y1=y1, log_y=log_y)


def line_plot(series: dict[str, tuple[list, list]], title: str, ylabel: str, band: dict | None = None,
              log_y: bool = False) -> str:
    """Lines over steps, with a predicted band (95% and 80% shaded, its centre dashed) behind them. The y-range is
    the lines' (`curve_ylim`): a wide band is clipped, so it never flattens the curves it surrounds."""
    steps = [x for xs, _ in series.values() for x in xs] + (list(band["step"]) if band else [])
    f = _frame(steps, _log_ylim(series) if log_y else curve_ylim(series), log_y)
    body, items = [], []
    if band:
        body += [_band(f, band["step"], band["lo95"], band["hi95"], _BAND, 0.15, "predicted 95%"),
                 _band(f, band["step"], band["lo80"], band["hi80"], _BAND, 0.25, "predicted 80%"),
                 *_line(f, band["step"], band["loss_pred"], _BAND, "predicted", dots=False, dash="6 4")]
        items += [("predicted 95%", _BAND, "0.15"), ("predicted 80%", _BAND, "0.25"), ("predicted", _BAND, "dash")]
    for i, (label, (xs, ys)) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        body += _line(f, xs, ys, colour, label, dots=len(xs) < 30)
        items.append((label, colour, "line"))
    return _figure(title, f, ylabel, body, items)


def forecast_plot(metrics: list[dict], band: dict) -> str:
    """The live forecast of the final loss at each eval against the ladder's predicted final band (flat)."""
    steps, final = series(metrics, "forecast/final")
    _, lo = series(metrics, "forecast/lo95")
    _, hi = series(metrics, "forecast/hi95")
    fixed_lo, fixed_hi, fixed = band["lo95"][-1], band["hi95"][-1], band["loss_pred"][-1]
    f = _frame(steps, _padded([*final, *lo, *hi, fixed_lo, fixed_hi, fixed]))
    strip = (f'<rect x="{f.left}" y="{f.py(fixed_hi):.1f}" width="{f.right - f.left}" '
             f'height="{f.py(fixed_lo) - f.py(fixed_hi):.1f}" fill="{_BAND}" fill-opacity="0.15">'
             "<title>ladder's predicted final, 95%</title></rect>")
    body = [strip, _hline(f, fixed, "ladder's predicted final", _BAND),
            _band(f, steps, lo, hi, _COLOURS[0], 0.25, "forecast 95%"),
            *_line(f, steps, final, _COLOURS[0], "forecast/final", dots=True)]
    items = [("ladder's predicted final, 95%", _BAND, "0.15"), ("ladder's predicted final", _BAND, "dash"),
             ("forecast 95%", _COLOURS[0], "0.25"), ("forecast/final", _COLOURS[0], "line")]
    return _figure("forecast of the final loss", f, "final loss (nats / token)", body, items)


def mixture_plot(snapshots: list[dict]) -> str:
    """The share of each domain in the tokens drawn between snapshots, stacked to 1 over steps."""
    domains = sorted({d for s in snapshots for d in s["tokens"]})
    steps = [s["step"] for s in snapshots]
    cumulative = np.array([[s["tokens"].get(d, 0) for d in domains] for s in snapshots], dtype=np.float64)
    # Shares of the tokens drawn since the previous snapshot: what the mixture was in that stretch.
    drawn = np.diff(np.vstack([np.zeros(len(domains)), cumulative]), axis=0)
    shares = drawn / np.maximum(drawn.sum(axis=1, keepdims=True), 1e-12)
    if steps[0] > 0:  # each share holds from the previous snapshot (or step 0) to its own step
        steps, shares = [0, *steps], np.vstack([shares[:1], shares])
    f = _frame(steps, (0.0, 1.0))
    tops = np.cumsum(shares, axis=1)
    body, items = [], []
    for d, domain in enumerate(domains):
        colour = _COLOURS[d % len(_COLOURS)]
        stretches = range(1, len(steps))  # stretch i runs from steps[i - 1] to steps[i] at row i's share
        upper = [f"{f.px(x):.1f},{f.py(tops[i, d]):.1f}" for i in stretches for x in (steps[i - 1], steps[i])]
        lower = [f"{f.px(x):.1f},{f.py(tops[i, d] - shares[i, d]):.1f}" for i in stretches
                 for x in (steps[i - 1], steps[i])]
        body.append(f'<polygon points="{" ".join(upper + lower[::-1])}" fill="{colour}" fill-opacity="0.85">'
                    f"<title>{html.escape(domain)}</title></polygon>")
        items.append((domain, colour, "0.85"))
    return _figure("data mixture (share of tokens drawn)", f, "share", body, items)


_VIRIDIS = ((0x44, 0x01, 0x54), (0x3b, 0x52, 0x8b), (0x21, 0x91, 0x8c), (0x5e, 0xc9, 0x62), (0xfd, 0xe7, 0x25))


def _viridis(t: float) -> str:
    """Viridis (matplotlib's default colour map) at t in [0, 1], interpolated between five of its colours."""
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    mix = [a + (b - a) * (t - i) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1])]
    return "#" + "".join(f"{round(c):02x}" for c in mix)


def router_load_heatmap(load: np.ndarray, step: int | None = None) -> str:
    """A router load array [L, E] (fraction of assignments per expert, per layer) as a heatmap with a colour bar;
    each cell names its layer, expert and load on hover."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"router load must be [layers, experts], got shape {load.shape}")
    layers, experts = load.shape
    cell_w, cell_h = min(48.0, 800 / max(experts, 1)), min(40.0, 480 / max(layers, 1))
    left, top = 64, 36
    right, bottom = left + round(experts * cell_w), top + round(layers * cell_h)
    finite = load[np.isfinite(load)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)

    def colour(v: float) -> str:
        return _viridis((v - lo) / (hi - lo) if hi > lo else 0.5) if math.isfinite(v) else "#ccc"

    bar, shades, height = right + 20, 32, bottom - top  # the colour bar: stacked shades, low at the bottom
    cells = [f'<rect x="{left + j * cell_w:.1f}" y="{top + i * cell_h:.1f}" width="{cell_w:.1f}" '
             f'height="{cell_h:.1f}" fill="{colour(load[i, j])}"><title>layer {i}, expert {j}: {load[i, j]:.4g}</title>'
             "</rect>" for i in range(layers) for j in range(experts)]
    cells += [f'<rect x="{bar}" y="{top + height * (shades - 1 - k) / shades:.1f}" width="14" '
              f'height="{height / shades + 0.5:.1f}" fill="{_viridis(k / (shades - 1))}"/>' for k in range(shades)]
    body = ['<g shape-rendering="crispEdges">', *cells, "</g>"]  # no hairline seams between cells or shades
    every_x, every_y = math.ceil(28 / cell_w), math.ceil(16 / cell_h)  # labels that do not overlap
    body += [f'<text x="{left + (j + 0.5) * cell_w:.1f}" y="{bottom + 16}" text-anchor="middle">{j}</text>'
             for j in range(0, experts, every_x)]
    body += [f'<text x="{left - 4}" y="{top + (i + 0.5) * cell_h + 4:.1f}" text-anchor="end">{i}</text>'
             for i in range(0, layers, every_y)]
    body.append(f'<text x="{(left + right) / 2:g}" y="{bottom + 34}" text-anchor="middle">expert</text>')
    body.append(f'<text transform="translate(18 {(top + bottom) / 2:g}) rotate(-90)" text-anchor="middle">layer</text>')
    for v in _ticks(lo, hi) if hi > lo else [lo]:
        y = bottom - (v - lo) / (hi - lo) * height if hi > lo else (top + bottom) / 2
        body.append(f'<text x="{bar + 18}" y="{y + 4:.1f}">{v:.3g}</text>')
    width = max(bar + 96, 340)  # the tick labels beside the bar, and room for the title
    body.append(f'<text transform="translate({width - 14} {(top + bottom) / 2:g}) rotate(-90)" '
                'text-anchor="middle">load</text>')
    title = "router load" + (f" at step {step}" if step is not None else "")
    return _document(title, width, bottom + 46, body)
