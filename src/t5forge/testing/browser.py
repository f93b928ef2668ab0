"""A page opened in a real browser, for tests: the system's Chromium (Debian: `apt-get install chromium`, or
`make browser-deps`) driven headless by Playwright (which cannot download a browser of its own here). Every
console error and uncaught exception is collected; the network is refused, so a page that needs anything
beyond its own file fails visibly.

    page = open_page(Path("report.html"), screenshot=Path("report.png"))
    assert not page.errors, page.errors"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# Chromium's own background traffic (updates, sync, field trials) is turned off: the page alone is tested.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def browser_path() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def unavailable_reason() -> str | None:
    """Why no page can be opened here (one line), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; it drives the system's Chromium)"
    if browser_path() is None:
        return "no Chromium found (Debian: apt-get install chromium; or `make browser-deps`)"
    return None


@dataclass
class OpenedPage:
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, refused requests
    texts: dict[str, str] = field(default_factory=dict)  # CSS selector -> the element's text as shown
    attributes: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # selector -> each match's data-*
    charts: int = 0  # plotly charts in the page
    drawn: int = 0  # of which drawn (each has its SVG)


def open_page(path: Path, screenshot: Path | None = None, texts: list[str] = (), attributes: list[str] = (),
              width: int = 1280, timeout_ms: int = 60_000) -> OpenedPage:
    """Open `path` (file://), wait until loaded, and read `texts` (selector -> text) and, for `attributes`
    selectors, every match's data-* attributes and text; a full-page screenshot to `screenshot`."""
    from playwright.sync_api import sync_playwright

    opened = OpenedPage()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path(), headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.on("console", lambda m: opened.errors.append(f"console {m.type}: {m.text}")
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: opened.errors.append(f"uncaught: {e}"))
            # Nothing but the file itself: a request for anything else is an error of the page.
            page.route(lambda url: not url.startswith("file:") and not url.startswith("data:"),
                       lambda route: (opened.errors.append(f"request to {route.request.url}"), route.abort()))
            page.goto(path.resolve().as_uri(), wait_until="load", timeout=timeout_ms)
            page.wait_for_load_state("networkidle", timeout=timeout_ms)
            for selector in texts:
                element = page.query_selector(selector)
                opened.texts[selector] = element.inner_text() if element is not None else None
            for selector in attributes:
                opened.attributes[selector] = page.eval_on_selector_all(
                    selector, "els => els.map(e => ({...e.dataset, text: e.innerText}))")
            opened.charts = page.eval_on_selector_all(".plotly-graph-div", "els => els.length")
            opened.drawn = page.eval_on_selector_all(".plotly-graph-div", "els => els.filter("
                                                     "e => e.querySelector('svg.main-svg')).length")
            if screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return opened
