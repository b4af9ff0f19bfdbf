"""How long each page of the built site takes to load in headless Chromium, one page at a time (issue 28).

Protocol: serve ``_build/html`` from a local HTTP server (``make book`` first), open every page of ``book/`` in one
headless Chromium, one after another, and read the page's navigation timing: ``domContentLoadedEventEnd`` (the
HTML parsed) and ``loadEventEnd`` (scripts, styles and images loaded), in milliseconds from the navigation's
start. One browser, one page at a time, so the numbers are those of a reader's machine with nothing else to do;
the site test, which runs two browsers at once on CI's two cores, allows twice the budget per page. Budget:
3,000 ms to the load event. Results go to ``benchmarks/results/site_load.json``.

Usage::

    python benchmarks/site_load.py            # about 3 minutes for the whole site
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import http.server
import json
import os
import shutil
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUDGET_MS = 3000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, default=ROOT / "_build" / "html")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(args.site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    pages = sorted(p.relative_to(args.site).with_suffix("").as_posix() for p in (args.site / "book").glob("*.html"))
    chromium = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
    times = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        warm = browser.new_page()
        warm.goto(f"{url}/book/intro.html", wait_until="load")  # the browser's own start-up is not a page's
        warm.close()
        for name in pages:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{url}/{name}.html", wait_until="load", timeout=120_000)
            dcl, load = page.evaluate("() => { const t = performance.getEntriesByType('navigation')[0]; return "
                                      "[t.domContentLoadedEventEnd - t.startTime, t.loadEventEnd - t.startTime]; }")
            times[name] = {"dom_content_loaded_ms": round(dcl), "load_ms": round(load),
                           "html_bytes": (args.site / f"{name}.html").stat().st_size}
            page.close()
        browser.close()
    server.shutdown()
    worst = max(times, key=lambda n: times[n]["load_ms"])
    over = [n for n, t in times.items() if t["load_ms"] >= BUDGET_MS]
    for n, t in sorted(times.items(), key=lambda kv: -kv[1]["load_ms"])[:10]:
        print(f"  {t['load_ms']:6d} ms  {t['html_bytes'] / 1e3:8.0f} kB  {n}")
    print(f"{len(times)} pages; slowest {worst} at {times[worst]['load_ms']} ms; over {BUDGET_MS} ms: {len(over)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "site_load.json").write_text(json.dumps(
        {"benchmark": "site_load", "date": dt.date.today().isoformat(), "machine": machine(), "budget_ms": BUDGET_MS,
         "over_budget": over, "pages": times}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
