"""The built site in a real browser (``make test-site``): headless Chromium (Debian's package, driven by
Playwright with the system executable) opens every page of ``docs/site/_build/_build/html`` over a local
HTTP server, with every request that leaves the server blocked and recorded.

Per page: it loads (HTTP 200); every image has loaded (natural width > 0); where the page holds math,
MathJax has typeset all of it without an error; a notebook page shows the verdict of each of its
findings in the ledger (``results/<model>/claims.json``); nothing was fetched from the network. One
full-page screenshot per page goes to ``docs/site/_build/screenshots`` (git-ignored).

Not part of ``make test``: it needs the site (``make site``) and Chromium (``apt install chromium``).
The file name keeps it out of the default collection (``tests/test_*.py``).
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("COMPENDIUM_SITE", ROOT / "docs" / "site" / "_build"))
HTML = SITE / "_build" / "html"
SHOTS = SITE / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
SKIP = {"genindex.html", "search.html"}  # Sphinx's generated index and search pages: no content of ours


def pages() -> list[str]:
    if not HTML.is_dir():
        raise FileNotFoundError(f"no site at {HTML}: run `make site` first")
    return sorted(str(p.relative_to(HTML)) for p in HTML.rglob("*.html")
                  if p.name not in SKIP and "_static" not in p.parts and "_sources" not in p.parts)


def verdicts_by_notebook() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in sorted((ROOT / "results").glob("*/claims.json")):
        for r in json.loads(f.read_text())["rows"]:
            out.setdefault(r["notebook"], set()).add(r["verdict"])
    return out


@pytest.fixture(scope="module")
def server():
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(HTML))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"no Chromium at {CHROMIUM}: apt install chromium (or set CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def test_site_has_every_notebook():
    names = {Path(p).stem for p in pages()}
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert notebooks and notebooks <= names, f"pages missing: {sorted(notebooks - names)}"
    assert {"index", "claims", "course", "glossary"} <= names


@pytest.mark.parametrize("page", pages())
def test_page_renders(page, server, browser):
    blocked: list[str] = []
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = ctx.new_page()

    def route(r):
        if r.request.url.startswith(server):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    tab.route("**/*", route)
    resp = tab.goto(f"{server}/{page}", wait_until="networkidle")
    assert resp is not None and resp.status == 200
    n_math = tab.locator(".math").count()
    if n_math:
        tab.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000)
        tab.evaluate("() => MathJax.startup.promise")
        typeset = tab.locator("mjx-container").count()
        assert typeset >= n_math, f"{page}: {typeset} of {n_math} math elements typeset"
        assert tab.locator("mjx-merror").count() == 0, f"{page}: MathJax reported an error"
    broken = tab.evaluate("() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
    assert not broken, f"{page}: images that did not load: {broken}"
    text = tab.inner_text("main" if tab.locator("main").count() else "body").lower()
    stem = Path(page).stem
    for v in sorted(verdicts_by_notebook().get(stem, ())):
        assert v in text, f"{page}: the verdict {v!r} of its ledger is not on the page"
    if stem in ("index", "claims"):
        assert any(v in text for vs in verdicts_by_notebook().values() for v in vs)
    if stem == "claims":  # the forest plot draws findings, not an empty frame
        m = re.search(r"(\d+) findings with an estimate", text)
        assert m and int(m.group(1)) > 0, "the claims page's forest plot draws no finding"
    SHOTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(SHOTS / (page.replace("/", "__").removesuffix(".html") + ".png")), full_page=True)
    ctx.close()
    assert not blocked, f"{page} requested the network: {blocked}"
