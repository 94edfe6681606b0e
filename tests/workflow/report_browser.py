"""Opens a Snakemake report in headless Chromium as a reader would and says what it showed.

A copy of the report gets a script that, once the report's app has loaded, opens the
fine-tuning section and shows the fine-tuning table (`table`) or the first figure (`figure`),
the way a click does, then writes what the browser found into the page: the sections, the
table's header and cells as the browser parsed them from the report's embedded page, the
captions, whether the image decoded (its natural width). `--dump-dom` returns that page, and a
screenshot of the same view is kept.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path

_SCRIPT = r"""
<script>
window.addEventListener("load", () => setTimeout(async () => {
  const check = {categories: Object.keys(categories)};
  const keys = Object.keys(results);
  const table = keys.find((k) => k.endsWith("/report/finetune.html")) || null;
  const fig = keys.find((k) => results[k].mime_type === "image/png") || null;
  Object.assign(check, {table: table, figure: fig});
  if (table) {
    const text = await (await fetch(results[table].data_uri)).text();
    const t = new DOMParser().parseFromString(text, "text/html").querySelector("table");
    check.table_header = t ? [...t.querySelectorAll("th")].map((c) => c.textContent) : [];
    check.table_cells = t ? [...t.querySelectorAll("tbody td")].map((c) => c.textContent) : [];
    check.table_caption = results[table].caption;
  }
  if (fig) check.figure_caption = results[fig].caption;
  const target = VIEW === "table" ? table : fig;
  if (target) {
    app.showCategory(Object.keys(categories).find(
      (c) => Object.values(categories[c]).some((files) => files.includes(target))));
    app.setView({content: VIEW === "table" ? "html" : "img",
                 contentPath: results[target].data_uri, resultPath: target});
  }
  setTimeout(() => {
    const img = document.querySelector("img[src^='data:image/png']");
    check.img_natural_width = img ? img.naturalWidth : 0;
    check.frame_shown = [...document.querySelectorAll("iframe")].some(
      (f) => (f.getAttribute("src") || "").startsWith("data:text/html"));
    const pre = document.createElement("pre");
    pre.id = "report-check";
    pre.textContent = JSON.stringify(check);
    document.body.appendChild(pre);
  }, 1000);
}, 500));
</script>
"""


def open_report(chromium: str, report: Path, view: str, screenshot: Path) -> dict:
    """What the browser showed of `report` in `view` ("table" or "figure"); saves a screenshot."""
    src = report.read_text()
    # The last </body>: the report embeds libraries whose strings contain the tag too.
    head, tag, tail = src.rpartition("</body>")
    page = report.with_name(f"{report.stem}-check-{view}.html")
    page.write_text(f"{head}<script>const VIEW = {json.dumps(view)};</script>{_SCRIPT}{tag}{tail}")
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--virtual-time-budget=15000", "--window-size=1400,900"]  # fmt: skip
    dom = _chromium_run([*args, "--dump-dom", page.resolve().as_uri()])
    found = re.search(r'<pre id="report-check">(.*?)</pre>', dom.stdout, re.S)
    assert found, f"the report's page did not run in Chromium: {dom.stderr[-2000:]}"
    shot = _chromium_run([*args, f"--screenshot={screenshot}", page.resolve().as_uri()])
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


def _chromium_run(cmd: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Headless Chromium now and then hangs before it loads anything (seen once in a full suite
    run: killed at 180 s, the same page rendered in 10 s alone): one more try after a hang;
    a second hang, or a page that does not run, still fails the test."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
