"""Screenshots of a `sao view` page for the docs (docs/images/), in the system's headless Chromium.

    python scripts/view_screenshots.py RUN OUT_PREFIX [--field adv]

Writes the page (`sao view RUN`), opens the newest traced trajectory whose actor step was taken and whose
reward is > 0 (else the best there is), colours it by `--field`, hovers one of its action tokens, and saves
OUT_PREFIX-trajectory.png; then OUT_PREFIX-curves.png of the curves tab. Needs the `test` extra
(playwright) and Debian's chromium (scripts/install.sh installs both).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import sync_playwright

from sao.runtime.view import collect, write_page

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--field", default="adv")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ns = ap.parse_args()
    page_path = write_page(Path(ns.run))
    data = collect(Path(ns.run))
    trajs = [t for t in data["runs"][0]["trajectories"] if t["traced"]]
    pick = max(trajs, key=lambda t: (t.get("actor") == "stepped", t["reward"] > 0, t["step"]))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=ns.chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 820})
        page.goto(Path(page_path).resolve().as_uri())
        page.check("#f-traced")
        page.fill("#f-smin", str(pick["step"]))
        page.fill("#f-smax", str(pick["step"]))
        page.click(f"tr.traj-row[data-key='{data['runs'][0]['name']}|{pick['step']}|{pick['id']}']")
        page.select_option("#color-field", ns.field)
        tokens = page.locator(".block.action .tok")
        tokens.nth(tokens.count() - 2 if tokens.count() > 1 else 0).hover()  # late: the tip covers little
        page.screenshot(path=f"{ns.out}-trajectory.png")
        page.click("#tab-curves")
        page.screenshot(path=f"{ns.out}-curves.png", full_page=True)
        browser.close()
    print(f"{ns.out}-trajectory.png, {ns.out}-curves.png")


if __name__ == "__main__":
    main()
