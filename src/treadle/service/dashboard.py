"""The dashboard's files: one page (`GET /dashboard`), its script and style, and the
charting library it draws with (uPlot 1.6.32, MIT, vendored: `static/uPlot.*`,
its licence `static/uPlot.LICENSE`), served from the package with no build step
and no network (the service may run without internet).

They are the same bytes for everyone and hold no data, so they are served without
a key (`limits.RequestGate` lets exactly `PUBLIC_PATHS` through, GET only);
every number the page shows comes from the key-checked JSON routes, which the
page calls with the key it asks for (docs/dashboard.md, docs/security.md).

The page's answers carry a strict Content-Security-Policy: scripts only from these
files (and the job timeline's one inline script, by its hash: the timeline is shown
in a sandboxed frame that inherits this policy), connections only to the service
itself, no plug-ins, no forms posted anywhere, never framed by another site.
"""

from __future__ import annotations

import base64
import hashlib
from importlib import resources

from treadle.page.trajectories import TIMELINE_SCRIPT

# name -> media type: the only files served (no path is read from a request).
ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
PAGE = "/dashboard"
STATIC = "/dashboard/static/"
PUBLIC_PATHS = frozenset({PAGE, *(STATIC + name for name in ASSETS if name != "dashboard.html")})


def asset(name: str) -> bytes:
    """One of `ASSETS`, from the package; KeyError for any other name."""
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files("treadle.service").joinpath("static", name).read_bytes()


def _script_hash(script: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"


CSP = ("default-src 'none'; "
       f"script-src 'self' {_script_hash(TIMELINE_SCRIPT)}; "
       # uPlot and the timeline set element styles; a style cannot run code.
       "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
           "referrer-policy": "no-referrer", "cache-control": "no-cache"}


__all__ = ["ASSETS", "CSP", "HEADERS", "PAGE", "PUBLIC_PATHS", "STATIC", "asset"]
