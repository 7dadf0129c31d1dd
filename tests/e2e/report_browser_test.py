"""`cadence report` of real runs, opened in a real headless Chromium (Debian's; .ci/run installs it):
the page loads with no network, and the screenshot shows each plot where the page lays it out."""
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.browser

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-quic", "--disable-sync",
         "--disable-background-networking", "--disable-component-update", "--hide-scrollbars",
         "--force-device-scale-factor=1", "--virtual-time-budget=10000"]
# Added to a copy of the page: where each plot landed, whether its image decoded, the page size.
PROBE = """<script>window.addEventListener('load', () => {
  const plots = [...document.querySelectorAll('img.plot')].map(i => {
    const b = i.getBoundingClientRect();
    return {x: b.left, y: b.top, w: b.width, h: b.height, decoded: i.complete && i.naturalWidth > 0};
  });
  const p = document.createElement('pre'); p.id = 'probe';
  p.textContent = JSON.stringify({plots, width: document.documentElement.scrollWidth,
                                  height: document.documentElement.scrollHeight});
  document.body.appendChild(p);
});</script>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return path


def browse(tmp_path, *args) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=120)


def train(run, *overrides):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=24",
                          "run.eval_every=4", "learner.sft.steps=10", "task.heldout_size=32", "run.progress=false",
                          *overrides], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]


def test_report_of_real_runs_renders_every_plot_in_chromium(tmp_path):
    from PIL import Image

    chromium()
    a, b = tmp_path / "fixed-B", tmp_path / "controller"
    train(a)
    train(b, "controller.enabled=true", "controller.window=4", "controller.dwell=4", "controller.hysteresis=0.0",
          "controller.min_batch_size=64", "controller.max_batch_size=256")
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "report", str(a), str(b), "--out", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=300)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert not re.search(r"https?://", page)  # nothing for the browser to fetch
    n_plots = page.count('<img class="plot"')
    assert n_plots >= 12  # reward x2, exact match x2, staleness, ESS, KL, tok/s x2, B, lr, loss, grad norm

    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.replace("</body>", PROBE + "</body>"))
    width = 1240  # the same window width for both passes, so the layout is the same
    dom = browse(tmp_path, f"--window-size={width},2000", "--dump-dom", probe_page.as_uri())
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout)
    assert found, dom.stderr[-2000:]
    layout = json.loads(found.group(1))
    assert len(layout["plots"]) == n_plots and all(p["decoded"] for p in layout["plots"])

    shot = tmp_path / "shot.png"
    w, h = width, int(layout["height"]) + 40
    browse(tmp_path, f"--window-size={w},{h}", f"--screenshot={shot}", out.as_uri())
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert image.shape[:2] == (h, w)
    pngs = re.findall(r'<img class="plot" alt="[^"]*" src="data:image/png;base64,([^"]+)"', page)
    for p, data in zip(layout["plots"], pngs):
        x, y = int(round(p["x"])) + 1, int(round(p["y"])) + 1  # inside the 1 px border
        want = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"), dtype=np.float64)
        ph, pw = want.shape[:2]
        assert (pw, ph) == (int(p["w"]) - 2, int(p["h"]) - 2)  # drawn at its own size, not rescaled
        region = image[y:y + ph, x:x + pw]
        ink = (region.min(axis=2) < 200).mean()  # non-white pixels: axes, ticks, lines, text
        assert 0.02 < ink < 0.6, (p, ink)
        # what the browser shows there is the plot's own picture (within a pixel of where the layout said)
        diff = min(np.abs(image[y + dy:y + dy + ph, x + dx:x + dx + pw] - want).mean()
                   for dy in (-1, 0, 1) for dx in (-1, 0, 1))
        assert diff < 1.0, (p, diff)
