#!/usr/bin/env python3
"""Load every page of the built book in headless Chromium, as a reader would, and check it.

    python scripts/check_book.py                  # after: jupyter-book build . -W
    python scripts/check_book.py --screenshots _build/screenshots

Serves `_build/html` on 127.0.0.1 (a free port), opens every page at 1,400 px and at 400 px
wide, and fails (exit status 1) on any of:

* a console error or an uncaught exception in the page;
* a response with status 400 or more (a 404 for a font, a script, an image, ...), or a
  request that failed;
* a request to any host other than the book's own server (the book must work offline: no
  CDN, no fonts from elsewhere); such requests are blocked, not sent;
* at 1,400 px, a code block or printed output wider than its box (it would need sideways
  scrolling);
* at either width, a page wider than the window (the reader would scroll the whole page
  sideways), a table that needs sideways scrolling, or a widget wider than the column;
* saved widget state on a page but no widget rendered from it.

Hidden cells ("Show solution") are opened before measuring, so solutions are checked too.
With --screenshots DIR, a full-page PNG of each page at each width is written to DIR (as the
reader first sees it: toggles closed).  Look at them after changing the book.

Needs the `playwright` Python package (requirements-dev.txt) and a Chromium binary: it uses
the system's (Debian: `apt-get install chromium chromium-driver`), never downloads one.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = (1400, 400)
HEIGHT = 900
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]

# Runs in the page: what a reader would have to scroll sideways to see.
MEASURE_JS = """
(checkBlocks) => {
  const problems = [];
  const short = (el) => (el.innerText || "").trim().split("\\n")[0].slice(0, 70);
  const doc = document.documentElement;
  if (doc.scrollWidth > window.innerWidth + 1) {
    // name the widest element that sticks out
    let worst = null, worstRight = window.innerWidth;
    for (const el of document.querySelectorAll("main *")) {
      const r = el.getBoundingClientRect();
      if (r.width && r.right > worstRight + 1 && getComputedStyle(el).position !== "fixed") {
        worst = el; worstRight = r.right;
      }
    }
    const what = worst ? `<${worst.tagName.toLowerCase()} class="${worst.className}">` : "?";
    problems.push(`page is ${doc.scrollWidth}px wide in a ${window.innerWidth}px window ` +
                  `(widest: ${what} ${worst ? short(worst) : ""})`);
  }
  if (checkBlocks) {
    for (const pre of document.querySelectorAll("main pre")) {
      if (pre.clientWidth && pre.scrollWidth > pre.clientWidth + 1) {
        problems.push(`code/output block needs sideways scrolling ` +
                      `(${pre.scrollWidth}px in ${pre.clientWidth}px): ${short(pre)}`);
      }
    }
  }
  for (const w of document.querySelectorAll("main .jupyter-widgets")) {
    const box = w.closest(".cell_output") || w.parentElement;
    const over = w.getBoundingClientRect().right - box.getBoundingClientRect().right;
    if (over > 1) problems.push(`widget sticks out of the column by ${over.toFixed(0)}px`);
  }
  for (const table of document.querySelectorAll("main table")) {
    // the theme puts tables in a scrolling box: a wide table is clipped, not overflowing
    let box = table.parentElement;
    while (box && box.tagName !== "MAIN" &&
           !["auto", "scroll", "hidden"].includes(getComputedStyle(box).overflowX)) {
      box = box.parentElement;
    }
    if (box && box.tagName !== "MAIN" && box.scrollWidth > box.clientWidth + 1) {
      problems.push(`table needs sideways scrolling (${box.scrollWidth}px in ` +
                    `${box.clientWidth}px): ${short(table)}`);
    }
  }
  const saved = document.querySelector(
    'script[type="application/vnd.jupyter.widget-state+json"]');
  if (saved && !document.querySelector("main .jupyter-widgets, main .widget-box")) {
    problems.push("the page has saved widget state but no widget rendered");
  }
  return problems;
}
"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def book_pages(html_dir: Path) -> list[str]:
    skip = ("_static", "_sources", "_images", "_sphinx_design_static")
    return sorted(p.relative_to(html_dir).as_posix() for p in html_dir.rglob("*.html")
                  if not p.relative_to(html_dir).parts[0].startswith(skip))


def check_page(page, base: str, path: str, width: int, shots: Path | None) -> list[str]:
    problems: list[str] = []
    origin = urlsplit(base).netloc

    def on_console(msg):
        if msg.type == "error":
            problems.append(f"console error: {msg.text}")

    def on_response(response):
        if response.status >= 400:
            problems.append(f"HTTP {response.status}: {response.url}")

    def on_failed(request):
        if urlsplit(request.url).netloc == origin:  # outside requests are reported below
            problems.append(f"request failed ({request.failure}): {request.url}")

    def on_route(route):
        url = route.request.url
        if urlsplit(url).scheme in ("http", "https", "ws", "wss") \
                and urlsplit(url).netloc != origin:
            problems.append(f"request to another host (blocked): {url}")
            route.abort()
        else:
            route.continue_()

    page.on("console", on_console)
    page.on("pageerror", lambda err: problems.append(f"uncaught exception: {err}"))
    page.on("response", on_response)
    page.on("requestfailed", on_failed)
    page.route("**/*", on_route)
    try:
        page.set_viewport_size({"width": width, "height": HEIGHT})
        page.goto(f"{base}/{path}", wait_until="networkidle", timeout=90_000)
        if page.query_selector('script[type="application/vnd.jupyter.widget-state+json"]'):
            try:  # the widget manager renders after load; give it a moment
                page.wait_for_selector("main .jupyter-widgets", timeout=15_000)
            except Exception:
                pass  # reported by MEASURE_JS
            page.wait_for_load_state("networkidle")
        if shots is not None:
            name = path.removesuffix(".html").replace("/", "__")
            page.screenshot(path=str(shots / f"{name}-{width}.png"), full_page=True)
        page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        page.wait_for_timeout(200)
        problems += page.evaluate(MEASURE_JS, width >= 1000)
    finally:
        page.unroute("**/*")
        page.remove_listener("console", on_console)
        page.remove_listener("response", on_response)
        page.remove_listener("requestfailed", on_failed)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=Path, default=ROOT / "_build" / "html",
                        help="the built book (default: _build/html)")
    parser.add_argument("--chromium", default="/usr/bin/chromium",
                        help="the Chromium binary (default: /usr/bin/chromium)")
    parser.add_argument("--screenshots", type=Path, default=None, metavar="DIR",
                        help="write a full-page PNG of every page at every width here")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)),
                        help="window widths in px, comma-separated (default: 1400,400)")
    args = parser.parse_args(argv)

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("check_book: needs the playwright package: pip install -r requirements-dev.txt",
              file=sys.stderr)
        return 2
    if not (args.html / "index.html").is_file():
        print(f"check_book: no built book in {args.html} (run: jupyter-book build . -W)",
              file=sys.stderr)
        return 2
    if not Path(args.chromium).exists():
        print(f"check_book: no Chromium at {args.chromium} "
              "(Debian: apt-get install chromium chromium-driver)", file=sys.stderr)
        return 2
    if args.screenshots is not None:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    widths = [int(w) for w in args.widths.split(",")]

    server, base = serve(args.html)
    pages = book_pages(args.html)
    passed = failed = 0
    try:
        with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
            browser = pw.chromium.launch_persistent_context(
                profile, executable_path=args.chromium, headless=True,
                args=CHROMIUM_FLAGS, viewport={"width": widths[0], "height": HEIGHT},
                service_workers="block")
            # every page is checked as a first visit (no theme choice remembered, ...)
            browser.add_init_script(
                "try { localStorage.clear(); sessionStorage.clear(); } catch (e) {}")
            try:
                for path in pages:
                    for width in widths:
                        page = browser.new_page()
                        try:
                            problems = check_page(page, base, path, width, args.screenshots)
                        finally:
                            page.close()
                        if problems:
                            failed += 1
                            print(f"FAIL {path} at {width}px")
                            for problem in dict.fromkeys(problems):  # once each, in order
                                print(f"     {problem}")
                        else:
                            passed += 1
                            print(f"ok   {path} at {width}px")
            finally:
                browser.close()
    finally:
        server.shutdown()
    if args.screenshots is not None:
        print(f"screenshots in {args.screenshots}")
    print(f"check_book: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
