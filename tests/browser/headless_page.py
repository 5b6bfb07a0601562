"""The dashboard open in Debian's headless Chromium, offline, for the browser tests (every request off the file
blocked, every console error, page error and dialog collected), and where on the page a heatmap draws its cells."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def browser_page(path: Path) -> Iterator[tuple[Any, list[str]]]:
    """``path`` open in headless Chromium with every request off the file blocked; yields the page and the list its
    console errors, page errors, dialogs and blocked requests are appended to."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})

        def block(route: Any) -> None:
            url = route.request.url
            if url.startswith("file:"):
                route.continue_()
            else:
                errors.append(f"blocked request: {url}")
                route.abort()

        page.route("**/*", block)
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("dialog", lambda dialog: errors.append(f"dialog opened: {dialog.message}"))
        page.goto(path.as_uri())
        try:
            yield page, errors
        finally:
            browser.close()


def open_groups(page: Any) -> None:
    """Open every collapsed group of tables (the runs' tables, the figures at k), as a reader would."""
    page.evaluate("document.querySelectorAll('details.group:not([open]) > summary').forEach(s => s.click())")


def cell_point(page: Any, figure: str, x: object, row: int) -> dict[str, float]:
    """Where on the page (viewport pixels) the heatmap cell at x value ``x`` and category row ``row`` is drawn."""
    page.locator(f"#{figure}").scroll_into_view_if_needed()
    point: dict[str, float] = page.evaluate(
        """([id, x, row]) => { const div = document.getElementById(id); const layout = div._fullLayout;
                               const box = div.getBoundingClientRect();
                               return {x: box.left + layout.xaxis._offset + layout.xaxis.l2p(x),
                                       y: box.top + layout.yaxis._offset + layout.yaxis.l2p(row),
                                       half: layout.xaxis._length / div.data[0].x.length / 2}; }""",
        [figure, x, row],
    )
    return point


def column_labels(page: Any, figure: str, point: dict[str, float]) -> list[str]:
    """The cell labels the heatmap writes in the column of ``point`` (``cell_point``)."""
    labels: list[str] = page.evaluate(
        """([id, x, half]) => [...document.querySelectorAll('#' + id + ' .heatmap-label text')]
               .filter(t => { const b = t.getBoundingClientRect(); return Math.abs(b.left + b.width / 2 - x) < half; })
               .map(t => t.textContent)""",
        [figure, point["x"], point["half"]],
    )
    return labels
