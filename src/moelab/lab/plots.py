"""The report's figures: matplotlib (Agg) PNGs of a run's curves, mixture and router load.

The report keeps PNG figures (inline in its HTML, files beside its Markdown) rather than the site's
inline SVG: its readers and its tests rely on images a Markdown viewer shows and a 1,000 px wide raster.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # headless: no display, and no backend guessing on a CI box
import matplotlib.pyplot as plt
import numpy as np

from moelab.lab.view import series

__all__ = ["line_plot", "curve_ylim", "router_load_heatmap", "mixture_plot", "forecast_plot"]


# Plots render about 1,000 px wide (10 in at 110 dpi, less the trimmed margins): legible at a normal page
# width, legends at 9 pt.
_FIGSIZE, _DPI, _LEGEND_PT = (10, 4.4), 110, 9


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def line_plot(series: dict[str, tuple[list, list]], title: str, ylabel: str, band: dict | None = None,
               log_y: bool = False) -> bytes:
    """Lines over steps, with a predicted band behind them; the y-range is the lines' (a wide band is clipped,
    so it never flattens the curves it surrounds)."""
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    if band:
        ax.fill_between(band["step"], band["lo95"], band["hi95"], alpha=0.15, color="C2", label="predicted 95%")
        ax.fill_between(band["step"], band["lo80"], band["hi80"], alpha=0.25, color="C2", label="predicted 80%")
        ax.plot(band["step"], band["loss_pred"], "--", color="C2", label="predicted")
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
    limits = curve_ylim(series)
    if log_y:
        ax.set_yscale("log")
    elif band and limits:
        ax.set_ylim(*limits)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.legend(fontsize=_LEGEND_PT, ncol=2)
    ax.grid(alpha=0.3)
    return _png(fig)


def curve_ylim(series: dict[str, tuple[list, list]]) -> tuple[float, float] | None:
    """The y-range of the lines alone, 5% padded; None without a finite value."""
    values = np.array([v for _, ys in series.values() for v in ys], dtype=np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    pad = 0.05 * max(float(values.max() - values.min()), 1e-3)
    return float(values.min()) - pad, float(values.max()) + pad


def router_load_heatmap(load: np.ndarray, step: int | None = None) -> bytes:
    """PNG of a router load array [L, E] (fraction of assignments per expert, per layer) as a heatmap."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"router load must be [layers, experts], got shape {load.shape}")
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * load.shape[1] + 2), max(2, 0.45 * load.shape[0] + 1.2)))
    im = ax.imshow(load, aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax, label="load")
    ax.set(xlabel="expert", ylabel="layer", title="router load" + (f" at step {step}" if step is not None else ""))
    ax.set_xticks(range(load.shape[1]))
    ax.set_yticks(range(load.shape[0]))
    return _png(fig)


def mixture_plot(snapshots: list[dict]) -> bytes:
    domains = sorted({d for s in snapshots for d in s["tokens"]})
    steps = [s["step"] for s in snapshots]
    cumulative = np.array([[s["tokens"].get(d, 0) for d in domains] for s in snapshots], dtype=np.float64)
    # Shares of the tokens drawn since the previous snapshot: what the mixture was in that stretch.
    drawn = np.diff(np.vstack([np.zeros(len(domains)), cumulative]), axis=0)
    shares = drawn / np.maximum(drawn.sum(axis=1, keepdims=True), 1e-12)
    if steps[0] > 0:  # each share holds from the previous snapshot (or step 0) to its own step
        steps, shares = [0, *steps], np.vstack([shares[:1], shares])
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    ax.stackplot(steps, shares.T, labels=domains, alpha=0.85, step="pre")
    ax.set(title="data mixture (share of tokens drawn)", xlabel="step", ylabel="share", ylim=(0, 1))
    ax.legend(fontsize=_LEGEND_PT, loc="upper right")
    return _png(fig)


def forecast_plot(metrics: list[dict], band: dict) -> bytes:
    """The live forecast of the final loss at each eval against the pre-registered final band (flat)."""
    steps, final = series(metrics, "forecast/final")
    _, lo = series(metrics, "forecast/lo95")
    _, hi = series(metrics, "forecast/hi95")
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    ax.axhspan(band["lo95"][-1], band["hi95"][-1], alpha=0.15, color="C2", label="pre-registered final 95%")
    ax.axhline(band["loss_pred"][-1], ls="--", color="C2", label="pre-registered final")
    ax.fill_between(steps, lo, hi, alpha=0.25, color="C0", label="forecast 95%")
    ax.plot(steps, final, marker="o", markersize=3, color="C0", label="forecast/final")
    ax.set(title="forecast of the final loss", xlabel="step", ylabel="final loss (nats / token)")
    ax.legend(fontsize=_LEGEND_PT, ncol=2)
    ax.grid(alpha=0.3)
    return _png(fig)
