"""The dashboard in headless Chromium, offline: no console errors, every figure drawn, the k picker redraws."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moetrace.cli import main
from trace_builder import Model, verify_tokens, write_trace

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.browser


@pytest.fixture
def dashboard(tmp_path: Path) -> Path:
    paths = []
    for index, name in enumerate(("<script>alert(1)</script>", "second")):
        model = Model(name=name, random_weights=index == 0, layers=(1, 2, 3))
        tokens = verify_tokens(np.random.default_rng(index), model, requests=3, steps=15, k=3, accept_prob=0.6,
                               variable_drafts=True)
        paths.append(str(write_trace(tmp_path / f"run{index}", tokens, model, k=3)))
    output = tmp_path / "dashboard.html"
    result = CliRunner().invoke(main, ["report", *paths, "--k", "3", "-o", str(output)])
    assert result.exit_code == 0, result.output
    return output


def test_dashboard_renders_offline_and_reacts_to_k(dashboard: Path) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    blocked: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})

        def block(route: object) -> None:
            url = route.request.url  # type: ignore[attr-defined]
            if url.startswith("file:"):
                route.continue_()  # type: ignore[attr-defined]
            else:
                blocked.append(url)
                route.abort()  # type: ignore[attr-defined]

        page.route("**/*", block)
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("dialog", lambda dialog: errors.append(f"dialog opened: {dialog.message}"))
        page.goto(dashboard.as_uri())
        figures = page.eval_on_selector_all(".figure", "nodes => nodes.map(n => n.id)")
        assert len(figures) == 6 + 2 * 2  # the prediction figure: the shipped preset predicts without flags
        decision_rows = page.eval_on_selector_all("#decision tr", "rows => rows.map(r => r.innerText)")
        assert len(decision_rows) == 1 + 2 * 4, decision_rows  # header, 2 runs × concurrencies 1, 8, 32, 128
        for figure in figures:
            page.wait_for_selector(f"#{figure} svg.main-svg", timeout=15_000)
            drawn = page.evaluate(
                """id => { const div = document.getElementById(id);
                           const points = div.querySelectorAll('.trace, .hm, image, .point, path.js-line').length;
                           return {traces: (div.data || []).length, points: points}; }""",
                figure,
            )
            assert drawn["traces"] > 0 and drawn["points"] > 0, (figure, drawn)
            shot = page.locator(f"#{figure}").screenshot()
            assert len(shot) > 8_000, f"{figure} looks blank ({len(shot)} bytes of PNG)"

        def plotted(figure: str) -> object:
            return page.evaluate(f"document.getElementById('{figure}').data.map(t => [t.x, t.y])")

        before = plotted("fig-unique-at-k"), plotted("fig-budget")
        page.select_option("#k-picker", "6")
        page.wait_for_function("document.getElementById('fig-unique-at-k').layout.title.text.endsWith('k=6')")
        after = plotted("fig-unique-at-k"), plotted("fig-budget")
        assert before[0] != after[0] and before[1] != after[1]
        page.select_option("#layer-picker", "2")
        page.wait_for_function("document.getElementById('fig-growth').layout.title.text.endsWith('layer 2')")
        browser.close()
    assert errors == []
    assert blocked == []
