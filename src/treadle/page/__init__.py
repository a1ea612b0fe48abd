"""The HTML page shell of treadle's reports: one self-contained document (no
network, no libraries), its style, the time axis's ticks and the hover tooltip.
Shared by the simulator's timeline (`treadle.sim.timeline`) and the per-trajectory
timeline of a job (`treadle.page.trajectories`: `treadle run`'s report and the
service's live view of a job), so that they read alike.

Drawings are SVG in `WIDTH` units, scaled to the window: a left gutter of `X0` for
labels and `PLOT_W` of plot.
"""

from __future__ import annotations

import html
import math

WIDTH = 1600.0  # drawing units; the SVG scales to the window width
X0 = 184.0  # left gutter, for the labels
PLOT_W = WIDTH - X0 - 16.0


def html_page(title: str, body: str, css: str = "") -> str:
    """A complete document: `title` (escaped) as its heading, the style `PAGE_CSS`
    plus `css`, then `body` (HTML)."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
            f"{html.escape(title)}</title><style>{PAGE_CSS}{css}</style></head><body><h1>"
            f"{html.escape(title)}</h1>{body}</body></html>\n")


def time_ticks(t0: float, t1: float) -> list[tuple[float, str]]:
    """About ten round tick values (1, 2 or 5 times a power of ten), with labels."""
    raw = (t1 - t0) / 10.0
    step = min(m * 10.0 ** math.ceil(math.log10(raw / m) - 1e-9) for m in (1.0, 2.0, 5.0))
    dec = max(0, -math.floor(math.log10(step) + 1e-9))
    lo, hi = math.ceil(t0 / step - 1e-9), math.floor(t1 / step + 1e-9)
    return [(i * step, f"{i * step:.{dec}f}") for i in range(lo, hi + 1)]


def hover_script(find: str) -> str:
    """The page's hover tooltip: `find` is JavaScript defining ``find(x, y)`` (drawing
    coordinates of the ``#tl`` SVG) that returns the tooltip's lines or null, with
    ``D`` (the ``#tl-data`` JSON), ``svg`` and ``tip`` in scope."""
    return ("(()=>{const D=JSON.parse(document.getElementById('tl-data').textContent),"
            "svg=document.getElementById('tl'),tip=document.getElementById('tip');"
            f"{find}{_HOVER}")


_HOVER = r"""
svg.addEventListener('mousemove',ev=>{const p=new DOMPoint(ev.clientX,ev.clientY).matrixTransform(
 svg.getScreenCTM().inverse()),r=find(p.x,p.y);tip.style.display=r?'block':'none';if(!r)return;
 tip.textContent=r.join('\n');tip.style.top=ev.clientY+14+'px';
 tip.style.left=Math.min(ev.clientX+14,innerWidth-tip.offsetWidth-8)+'px';});
svg.addEventListener('mouseleave',()=>{tip.style.display='none';});})();"""


PAGE_CSS = """body{font:13px/1.45 system-ui,sans-serif;margin:14px 18px;color:#222}
h1{font-size:18px;margin:0 0 2px}.sum{margin:0 0 4px;color:#333}.empty{color:#666}
.legend{display:flex;flex-wrap:wrap;gap:2px 12px;font-size:12px;color:#444;margin-bottom:4px}
.legend i{display:inline-block;width:14px;height:9px;margin-right:4px;vertical-align:middle}
.axis{position:sticky;top:0;background:#fff;z-index:1;border-bottom:1px solid #ddd}
svg{display:block;width:100%;height:auto}svg text{font-family:system-ui,sans-serif}
.lab{font-size:11.5px;font-weight:600}.tp{font-weight:400;fill:#555}.sub{font-size:9.5px;fill:#666}
.tk{font-size:11px;fill:#444}.grid{stroke:#000;stroke-opacity:.09}.qm{stroke:#000;
stroke-opacity:.5;stroke-dasharray:3 2}.mig path{fill:none;stroke:#c51b8a;stroke-opacity:.3;
stroke-width:.8;marker-end:url(#arr)}#tip{position:fixed;display:none;pointer-events:none;
color:#fff;padding:4px 8px;background:rgba(20,20,20,.92);border-radius:4px;font-size:12px;
white-space:pre;z-index:2}"""
