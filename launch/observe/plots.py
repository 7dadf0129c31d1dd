"""Plots for reports (`cadence report`, `cadence experiment`): panels of lines drawn with matplotlib.

    panel = Panel("reward", xlabel="samples", ylabel="reward", lines=[Line(x, y, label="run a")],
                  marks=[Mark(x=3200, label="B 128 -> 256")])
    save_png([panel, other], "curves.png")        # one figure, panels side by side
    data = png_bytes([panel])                       # the same, as PNG bytes (an HTML data: URI)

A figure is described as data (Panel, Line, Mark) and drawn in one place, so every report looks
alike and tests can check what was drawn without a picture. The PNG carries no metadata (no
"Software" URL): an HTML report that inlines it holds no external address.
"""
from __future__ import annotations

import base64
import dataclasses
import io
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class Line:
    x: Sequence[float]
    y: Sequence[float]
    label: str | None = None
    fmt: str = "-"  # matplotlib format: "-", "o", "o-", "s--", "^", ...
    color: Any = None
    alpha: float = 1.0
    lw: float | None = None
    ms: float | None = None
    mfc: str | None = None  # marker face colour ("none" = hollow)


@dataclasses.dataclass(frozen=True)
class Mark:
    """A vertical line at x (e.g. a controller decision), with a short label."""
    x: float
    label: str = ""
    color: Any = "gray"


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    lines: Sequence[Line] = ()
    hlines: Sequence[float] = ()  # dashed horizontal references (a target score)
    marks: Sequence[Mark] = ()
    xlog2: bool = False
    legend: bool = True
    legend_fontsize: float | None = None


def pyplot():
    """matplotlib.pyplot with the file-only backend (the `plots` extra)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'cadence-rl[plots]' (or -e '.[plots]' in a checkout)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colors(n: int) -> list:
    """n distinguishable colours along viridis (ordered: small -> large)."""
    plt = pyplot()
    return list(plt.cm.viridis([i / max(n - 1, 1) for i in range(n)]))


def draw(panels: Sequence[Panel], ncols: int | None = None, panel_size=(5.0, 4.0), sharey: bool = False):
    """A matplotlib figure with one axes per panel (ncols per row; default all in one row)."""
    plt = pyplot()
    ncols = ncols or len(panels)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows),
                             sharey=sharey, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, p in zip(flat, panels):
        _draw_panel(ax, p)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def _draw_panel(ax, p: Panel) -> None:
    for ln in p.lines:
        kw = {k: v for k, v in (("color", ln.color), ("lw", ln.lw), ("ms", ln.ms), ("mfc", ln.mfc)) if v is not None}
        ax.plot(list(ln.x), list(ln.y), ln.fmt, alpha=ln.alpha, label=ln.label, **kw)
    for y in p.hlines:
        ax.axhline(y, color="gray", ls="--", lw=1)
    for m in p.marks:
        ax.axvline(m.x, color=m.color, ls=":", lw=1)
        if m.label:
            ax.annotate(m.label, (m.x, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                        va="top", ha="right", color=m.color)
    if p.xlog2:
        ax.set_xscale("log", base=2)
    if p.title:
        ax.set_title(p.title, fontsize=10)
    if p.xlabel:
        ax.set_xlabel(p.xlabel)
    if p.ylabel:
        ax.set_ylabel(p.ylabel)
    ax.grid(alpha=0.3)
    if p.legend and any(ln.label for ln in p.lines):
        ax.legend(fontsize=p.legend_fontsize)


def png_bytes(panels: Sequence[Panel], dpi: int = 110, **kw) -> bytes:
    fig = draw(panels, **kw)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    pyplot().close(fig)
    return buf.getvalue()


def save_png(panels: Sequence[Panel], path: str, dpi: int = 110, **kw) -> None:
    with open(path, "wb") as f:
        f.write(png_bytes(panels, dpi=dpi, **kw))


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
