"""The report's HTML in headless Chromium at 1400 px: every table column visible, no inner scroll bar.

Skipped where no ``chromium`` is installed (``apt-get install -y chromium``); the CSS itself is checked
without a browser in ``tests/report/test_report_findings.py``.
"""

import json
import re
import shutil
import subprocess

import pytest

from covgrad.report import Report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROBE = """<script>window.addEventListener('load', () => {
  const out = [], vw = document.documentElement.clientWidth;
  document.querySelectorAll('*').forEach(e => {
    const cs = getComputedStyle(e), ov = cs.overflowX + '/' + cs.overflowY;
    if (/(auto|scroll|hidden)/.test(ov) && (e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1))
      out.push('inner scroll: ' + e.tagName + '.' + e.className);
  });
  document.querySelectorAll('table').forEach((t, i) => {
    const r = t.getBoundingClientRect();
    if (r.right > vw + 1) out.push('table ' + i + ' wider than the page: ' + r.right + ' > ' + vw);
    t.querySelectorAll('th').forEach(th => {
      if (th.getBoundingClientRect().width < 8) out.push('hidden ' + th.textContent);
    });
  });
  const d = document.createElement('pre'); d.id = 'probe';
  d.textContent = JSON.stringify({vw: vw, tables: document.querySelectorAll('table').length, problems: out});
  document.body.appendChild(d);
});</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_every_column_visible_at_1400px_without_inner_scroll_bars(tmp_path):
    wide = [{f"bf16_predictor_{i}_precision": 0.123456789 * i for i in range(24)} for _ in range(3)]
    long_names = [{"tensor": "model.layers.29.self_attn.q_proj.weight." * 3, "share": 0.5}]
    report = Report(title="wide", blocks=[("table", wide), ("table", long_names), ("p", "text")])
    page = tmp_path / "report.html"
    page.write_text(report.html().replace("</body>", PROBE + "</body>"))
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,2000"]
    cmd += ["--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<pre id="probe">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    result = json.loads(found.group(1).replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&"))
    assert result["tables"] == 2 and result["vw"] > 1300
    assert result["problems"] == [], result
