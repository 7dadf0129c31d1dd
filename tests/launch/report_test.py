"""`cadence report`: what it plots and how it smooths, on hand-made metrics (a real report opened in
Chromium: tests/e2e/report_browser_test.py)."""
import base64
import json
import re

import numpy as np
import pytest

from cadence.launch import cli

from cadence.launch.observe import plots

from cadence.launch.observe import report
from tests.launch.status_test import beat, make_run, records


def test_moving_average_matches_a_plain_loop():
    y = np.random.default_rng(0).normal(size=57)
    for w in (1, 2, 5, 57, 100):
        expected = [np.mean(y[max(0, i + 1 - w): i + 1]) for i in range(len(y))]
        np.testing.assert_allclose(report.moving_average(y, w), expected, rtol=1e-12)


def test_series_smooths_and_thins_long_runs():
    rows = [{"step": s, "samples": 8 * s, "reward/mean": float(s % 2)} for s in range(1, 100001)]
    x, y, w = report.series(rows, "reward/mean", "samples", smooth=True)
    assert w == 500 and len(x) <= report.MAX_POINTS + 1 and x[-1] == 800000
    assert np.allclose(y[10:], 0.5, atol=1e-3)  # 0/1 alternating averages to 1/2
    x, y, w = report.series(rows[:50], "reward/mean", "samples", smooth=True)
    assert w == 1 and len(x) == 50  # short runs are drawn as measured


def controller_records(n=40):
    rows = records(n, b=64)
    rows[12].update({"controller/decision": "hold B=64: dwell (2 < 20 steps since the last change)",
                     "controller/action": "hold"})
    rows[20].update({"controller/decision": "grow B 64 -> 128: predicted 12.0% faster to target; B_noise 300",
                     "controller/action": "grow", "controller/noise_scale": 300.0})
    for r in rows[21:]:
        r["batch_size"] = 128
    return rows


def test_report_is_self_contained_and_marks_decisions(tmp_path, capsys):
    a = make_run(tmp_path / "a", records=records(40), hb=beat("finished"), summary={"preempted": False})
    b = make_run(tmp_path / "b", records=controller_records(), hb=beat())
    out = tmp_path / "cmp.html"
    assert cli.main(["report", a, b, "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["report"] == str(out)
    text = out.read_text()
    assert not re.search(r"https?://", text, re.I)  # no external address
    assert all(v.startswith("data:") for v in re.findall(r'(?:src|href)="([^"]*)"', text))  # nor a relative one
    assert "url(" not in text and "@import" not in text
    imgs = re.findall(r'<img class="plot" alt="([^"]*)" src="data:image/png;base64,([^"]+)"', text)
    titles = [t for t, _ in imgs]
    # batch size over time is drawn (both runs have it); noise scale only from run b; no loss anywhere
    assert {"training reward", "held-out exact match over time", "batch size", "noise-scale estimate"} <= set(titles)
    assert "loss" not in titles
    for _, data in imgs:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "grow B 64 -&gt; 128" in text and "hold B=64" not in text  # decisions table: changes only
    assert "finished" in text and "running" in text


def test_batch_size_panel_marks_the_decision_at_its_time(tmp_path):
    b = make_run(tmp_path / "b", records=controller_records(), hb=beat())
    panels = {p.title: (p, cap) for _, p, cap in report.build_panels([report.load_run(b)])}
    panel, caption = panels["batch size"]
    assert [(m.x, m.label) for m in panel.marks] == [(10.0 + 20 * 0.5, "B 64→128")]
    assert "controller's decisions" in caption
    (line,) = panel.lines
    assert list(line.y[:21]) == [64] * 20 + [128]


def test_missing_run_dir_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 1
    assert "not a Cadence run directory" in capsys.readouterr().err


def test_png_has_no_metadata_url():
    png = plots.png_bytes([plots.Panel("t", "x", "y", [plots.Line([0, 1], [1, 2])])])
    assert b"matplotlib.org" not in png and b"http" not in png


def test_experiment_plots_use_the_shared_module(tmp_path, monkeypatch):
    from cadence.launch.experiments import batch_invariance

    drawn = []
    monkeypatch.setattr(plots, "save_png", lambda panels, path, **kw: drawn.append((panels, kw)))
    recs = [{"scaling": "sqrt", "batch_size": b, "curve": [(0, 0.0, 0.1), (100 * b, 1.0, 0.6)]} for b in (16, 32)]
    batch_invariance.plot(recs, (16, 32), ("sqrt",), 0.5, "eval/exact_match", str(tmp_path / "c.png"))
    ((panel,), kw) = drawn[0]
    assert panel.hlines == [0.5] and [ln.label for ln in panel.lines] == ["B=16", "B=32"]
    assert kw == {"sharey": True}


@pytest.mark.parametrize("n", [1, 3])
def test_one_run_report_defaults_into_its_folder(tmp_path, n):
    run = make_run(tmp_path / "r", records=records(n), hb=beat("finished"), summary={"preempted": False})
    assert report.write_report([run]) == str(tmp_path / "r" / "report.html")


def test_without_matplotlib_the_report_says_which_extra(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "r", records=records(3), hb=beat("finished"), summary={"preempted": False})
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert cli.main(["report", run]) == 1
    assert "cadence-rl[plots]" in capsys.readouterr().err


def test_report_shows_a_plugin_tasks_own_metrics(tmp_path):
    """A task without exact match: its held-out reward in the table and a plot, and one plot per
    eval/<name> and task/<name> it reports."""
    rows = [{"step": 0, "samples": 0, "wall_time": 1.0, "eval/reward": 0.2, "eval/tool_use": 0.4}]
    for s in range(1, 21):
        r = {"step": s, "samples": 8 * s, "wall_time": 1.0 + s, "reward/mean": 0.3, "task/tool_use": s / 20}
        if s % 10 == 0:
            r.update({"eval/reward": 0.25 + s / 100, "eval/tool_use": 0.5 + s / 100})
        rows.append(r)
    run = make_run(tmp_path / "r", records=rows, hb=beat("finished"), summary={"preempted": False})
    text = open(report.write_report([run])).read()
    titles = re.findall(r'<img class="plot" alt="([^"]*)"', text)
    assert {"held-out reward", "held-out tool_use", "training tool_use"} <= set(titles)
    assert "held-out exact match" not in titles  # the task has none
    assert "<th>final held-out reward</th>" in text and "<td>0.450</td>" in text
