"""Experiments: time-to-target arithmetic, summaries and reports on hand-made runs; the CLI end to end."""
import json
import os

import pytest

from cadence.launch.cli import main, split_overrides
from cadence.launch.experiments import batch_invariance, common
from cadence.launch.config import load_config
from cadence.launch.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record(b, scaling, seed, values, step=64):
    curve = [(i * step, i * 2.0, v) for i, v in enumerate(values)]
    return {"batch_size": b, "scaling": scaling, "seed": seed, "curve": curve, "run_dir": "x"}


def test_crossing_interpolates_between_evaluations():
    curve = [(0, 0.0, 0.1), (100, 10.0, 0.3), (200, 20.0, 0.7)]
    assert common.crossing(curve, 0.5) == pytest.approx((150.0, 15.0))
    assert common.crossing(curve, 0.05) == (0.0, 0.0)
    assert common.crossing(curve, 0.8) is None


def test_auto_target_halfway_to_the_median_best():
    recs = [record(16, "sqrt", 0, [0.1, 0.3, 0.5]), record(32, "sqrt", 0, [0.1, 0.2, 0.3]),
            record(64, "sqrt", 0, [0.1, 0.05, 0.1])]  # never improves
    t = common.auto_target(recs)
    assert t == pytest.approx(0.1 + 0.5 * (0.3 - 0.1))
    common.add_time_to_target(recs, t)
    assert recs[0]["samples_to_target"] < recs[1]["samples_to_target"]
    assert recs[2]["samples_to_target"] is None  # a flat run does not reach it


def test_median_to_target_counts_a_run_that_never_reached_as_slowest():
    def run(samples, end=500):
        return dict(record(16, "sqrt", 0, [0.0, 0.1]), samples_to_target=samples, wall_to_target=None,
                    curve=[(0, 0.0, 0.0), (end, 9.0, 0.1)])

    assert common.median_to_target([run(100), run(200), run(None)], "samples_to_target") == (200.0, True)
    # the median seed never reached: its budget (samples at its last evaluation) is a lower bound
    assert common.median_to_target([run(100), run(None, 400), run(None, 600)], "samples_to_target") == (400.0, False)
    assert common.median_to_target([run(None, 400)], "wall_to_target") == (9.0, False)
    assert common.median_to_target([run(100), run(300)], "samples_to_target") == (200.0, True)
    assert common.median_to_target([], "samples_to_target") == (None, False)


def test_summary_spread_is_relative_to_the_mean_of_per_batch_medians():
    recs = []
    for seed, (a, b) in enumerate([(100, 150), (120, 130), (110, 300)]):  # medians 110 and 150
        recs += [dict(record(16, "sqrt", seed, []), samples_to_target=a),
                 dict(record(32, "sqrt", seed, []), samples_to_target=b)]
    recs.append(dict(record(16, "none", 0, []), samples_to_target=100))
    recs.append(dict(record(32, "none", 0, []), samples_to_target=None))  # not reached
    s = batch_invariance.summarize(recs, (16, 32), ("sqrt", "none"))
    assert s["sqrt"]["samples_to_target"] == {"16": 110, "32": 150}
    assert s["sqrt"]["spread"] == pytest.approx(40 / 130)
    assert s["none"]["spread"] is None and not s["none"]["all_reached"]
    assert s["none"]["reached"] == {"16": "1/1", "32": "0/1"} and s["none"]["samples_to_target"]["32"] is None
    # per seed: 50/125, 10/125, 190/205 -> median 0.4; "none" has no seed that reached at both B
    assert s["sqrt"]["paired_spread"] == pytest.approx(0.4) and s["sqrt"]["paired_seeds"] == 3
    assert s["none"]["paired_spread"] is None and s["none"]["paired_seeds"] == 0


def test_paired_spread_skips_seeds_that_missed_a_batch_size():
    recs = [dict(record(16, "sqrt", 0, []), samples_to_target=100),
            dict(record(32, "sqrt", 0, []), samples_to_target=120),
            dict(record(16, "sqrt", 1, []), samples_to_target=300),
            dict(record(32, "sqrt", 1, []), samples_to_target=None),
            dict(record(16, "sqrt", 2, []), samples_to_target=200)]  # B=32 missing for seed 2
    assert batch_invariance.paired_spread(recs, (16, 32)) == (pytest.approx(20 / 110), 1)


def test_curves_plot_is_written(tmp_path):
    recs = [record(16, "sqrt", 0, [0.1, 0.3]), record(32, "none", 0, [0.1, 0.2])]
    path = tmp_path / "curves.png"
    batch_invariance.plot(recs, (16, 32), ("sqrt", "none"), 0.2, "eval/reward", str(path))
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_a_bad_override(capsys, tmp_path):
    assert main(["experiment", "batch-invariance", "--quick", "--out", str(tmp_path), "learner.nope=1"]) == 2
    assert "learner.nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["experiment", "no-such-experiment"])


def test_overrides_may_follow_list_options(capsys, tmp_path):
    # `--seeds 0 1` used to swallow the override after it and fail as "invalid int value"
    argv = ["experiment", "batch-invariance", "--seeds", "0", "1", "learner.optimizer.lr=3e-4",
            "--out", "runs/x.y=1", "--scalings", "sqrt", "run.steps=2"]
    rest, overrides = split_overrides(argv)
    assert overrides == ["learner.optimizer.lr=3e-4", "run.steps=2"]
    assert rest == ["experiment", "batch-invariance", "--seeds", "0", "1", "--out", "runs/x.y=1",
                    "--scalings", "sqrt"]
    # and a bad key placed there is still checked against the config, by name
    assert main(["experiment", "batch-invariance", "--quick", "--out", str(tmp_path), "--seeds", "0",
                 "learner.nope=1"]) == 2
    assert "learner.nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "some-dir", "run.steps=1"])  # eval takes no overrides


def test_the_decision_rule_plot_draws_x_e_t_and_the_controllers_path(tmp_path, monkeypatch):
    from cadence.launch.experiments import decision_rule
    from cadence.launch.observe import plots

    rows = {8: dict(samples_per_second=0.37, samples_to_target=400.0, reached=True, measured_relative=1.0,
                    predicted_relative=1.0),
            64: dict(samples_per_second=0.67, samples_to_target=768.0, reached=False, measured_relative=1.2,
                     predicted_relative=1.5)}
    fixed = [dict(record(8, "sqrt", 0, [0.1, 0.3]), batch_size=8), dict(record(64, "sqrt", 0, [0.1, 0.2]), batch_size=64)]
    ctrl = [dict(record("controller", "sqrt", 0, [0.1, 0.3]), batch_sizes=[8, 8, 16, 16])]
    drawn = []
    monkeypatch.setattr(plots, "save_png", lambda panels, path, **kw: drawn.append(panels))
    decision_rule._plot(rows, ctrl, fixed, str(tmp_path / "d.png"), noise_scale=64.0)
    x, e, t, curves, path = drawn[0]
    assert list(x.lines[0].x) == [8, 64] and list(x.lines[0].y) == [0.37, 0.67]
    assert [ln.label.split(" (")[0] for ln in e.lines] == ["measured", "lower bound", "1 + B/B_noise"]
    assert list(e.lines[2].y) == pytest.approx([400.0, 400.0 / 1.125 * 2])  # through B=8, the best reached
    assert list(path.lines[0].x) == [8, 16, 32, 48] and list(path.lines[0].y) == [8, 8, 16, 16]
    monkeypatch.undo()
    decision_rule._plot(rows, ctrl, fixed, str(tmp_path / "d.png"), noise_scale=64.0)
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_an_experiments_size_settings_yield_to_the_users_config_file(tmp_path, monkeypatch):
    """The full size's task.heldout_size=2048 applies only where the user set none: a --config
    with heldout_size 64 (SmolLM2's decision-rule config) once evaluated 2,048 prompts instead."""
    from cadence.launch import experiments

    seen = []
    monkeypatch.setattr(experiments, "run_experiment", lambda name, base, *a, **k: (seen.append(base), {"out": "x"})[1])
    config = tmp_path / "c.yaml"
    config.write_text("task:\n  heldout_size: 64\n")
    for argv, want in ([["--config", str(config)], 64], [["--config", str(config), "task.heldout_size=32"], 32],
                       [[], 2048], [["--quick"], 64]):
        assert main(["experiment", "decision-rule", "--out", str(tmp_path / "x"), *argv]) == 0
        assert seen[-1].task.heldout_size == want, argv
    assert seen[-1].learner.sft.steps == 10  # the quick size's other setting, which no one set


def test_the_decision_rule_controller_starts_where_asked():
    from cadence.launch.experiments.decision_rule import QUICK, controller_start

    assert controller_start({**QUICK, "batch_sizes": (64, 16, 32)}) == 32  # the middle, by default
    assert controller_start({**QUICK, "batch_sizes": (64, 16, 32), "controller_start": "smallest"}) == 16
    with pytest.raises(ValueError, match="^controller_start:"):
        controller_start({**QUICK, "controller_start": "largest"})
    rest, overrides = split_overrides(["experiment", "decision-rule", "--controller-start", "smallest",
                                       "--dwell", "8", "run.steps=2"])
    assert overrides == ["run.steps=2"] and rest[-4:] == ["--controller-start", "smallest", "--dwell", "8"]


@pytest.mark.slow
def test_batch_invariance_quick_end_to_end(tmp_path, capsys):
    """The CI smoke at its smallest: two batch sizes, two rules, one seed (~1-2 minutes on 2 cores)."""
    out = tmp_path / "exp"
    rc = main(["experiment", "batch-invariance", "--quick", "--out", str(out), "--batch-sizes", "16", "32",
               "--scalings", "sqrt", "none", "--max-samples", "128", "--eval-samples", "32",
               "learner.sft.steps=3", "task.heldout_size=16"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out"] == str(out)
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 4
    assert {(r["batch_size"], r["scaling"]) for r in results["runs"]} == {(16, "sqrt"), (32, "sqrt"),
                                                                         (16, "none"), (32, "none")}
    # the sqrt rule's Adam values were applied (base batch 128): lr * sqrt(B / 128)
    lr = {(r["batch_size"], r["scaling"]): r["lr"] for r in results["runs"]}
    assert lr[(32, "sqrt")] == pytest.approx(2 * lr[(16, "sqrt")] / 2 ** 0.5)
    assert lr[(16, "none")] == lr[(32, "none")]
    for r in results["runs"]:
        assert r["noise_scale"] is None or r["noise_scale"] > 0  # >= 2 microbatches: estimated
        assert r["curve"][-1][0] == 128 and os.path.isfile(os.path.join(r["run_dir"], "metrics.jsonl"))
    assert set(results["summary"]) == {"sqrt", "none"}
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "Batch invariance" in report and "curves.png" in report and "| sqrt |" in report


@pytest.mark.slow
def test_the_decision_rules_controller_run_is_reused_with_its_decisions(tmp_path, monkeypatch):
    """An experiment grown by a seed in a later session retrains nothing it already finished, the
    controller's run included (its decisions were kept beside it, not only in the controller object)."""
    from cadence.launch.experiments import decision_rule
    from cadence.launch.experiments.decision_rule import controller_runs
    from cadence.launch.run import train as train_module

    base = load_config(overrides=["learner.sft.steps=0", "task.heldout_size=8", "run.progress=false"])
    p = dict(batch_sizes=(16, 32), seeds=(0,), max_samples=64, eval_samples=32, metric="eval/reward",
             window=1, dwell=1, controller_start="smallest")
    made, make = [], decision_rule.make_controller  # the controllers the runs were given
    monkeypatch.setattr(decision_rule, "make_controller", lambda *a: (made.append(make(*a)), made[-1])[1])
    first = controller_runs(base, str(tmp_path), p, log=lambda *_: None)
    assert len(made) == 1 and made[0].decisions  # at least its first measurement's entry
    saved = json.load(open(tmp_path / "runs" / "controller-s0" / "controller_decisions.json"))
    assert [d["batch_size"] for d in saved] == [d["batch_size"] for d in made[0].decisions]
    assert first[0]["controller_decisions"] == saved

    real_train, trained = train_module.train, []
    monkeypatch.setattr(train_module, "train", lambda cfg, run_dir, **k: (trained.append(run_dir),
                                                                          real_train(cfg, run_dir, **k))[1])
    again = controller_runs(base, str(tmp_path), {**p, "seeds": (0, 1)}, log=lambda *_: None)
    assert trained == [str(tmp_path / "runs" / "controller-s1")]  # seed 0 reused, seed 1 trained
    assert again[0]["controller_decisions"] == saved and again[0]["curve"] == first[0]["curve"]
    assert json.load(open(tmp_path / "runs" / "controller-s1" / "controller_decisions.json"))

    os.remove(tmp_path / "runs" / "controller-s1" / "controller_decisions.json")  # as if it died in train()
    trained.clear()
    controller_runs(base, str(tmp_path), {**p, "seeds": (1,)}, log=lambda *_: None)
    assert trained == [str(tmp_path / "runs" / "controller-s1")]  # redone whole


def test_train_or_reuse_reuses_only_a_finished_run_of_the_same_config(tmp_path):
    from cadence.launch.config import load_config

    run_dir = str(tmp_path / "run")
    cfg = load_config(overrides=["run.steps=1", "run.eval_every=0", "learner.sft.steps=0", "task.heldout_size=8",
                                 "run.progress=false", f"run.dir={run_dir}"])
    first = common.train_or_reuse(cfg, run_dir, None, log=lambda *_: None)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    stamp = os.stat(metrics).st_mtime_ns
    again = common.train_or_reuse(cfg, run_dir, None, log=lambda *_: None)
    assert again == json.load(open(os.path.join(run_dir, "summary.json"))) and again["steps"] == first["steps"]
    assert os.stat(metrics).st_mtime_ns == stamp  # not trained again
    import dataclasses
    import shutil
    moved = str(tmp_path / "moved")
    shutil.copytree(run_dir, moved)  # a copied experiment folder still counts as the same run
    moved_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=moved))
    assert common.train_or_reuse(moved_cfg, moved, None, log=lambda *_: None) == again
    other = load_config(overrides=["run.steps=2", "run.eval_every=0", "learner.sft.steps=0", "task.heldout_size=8",
                                   "run.progress=false", f"run.dir={run_dir}"])
    with pytest.raises(FileExistsError, match="another config"):
        common.train_or_reuse(other, run_dir, None)
    summary_path = os.path.join(run_dir, "summary.json")
    json.dump({**again, "preempted": True}, open(summary_path, "w"))  # SIGTERM also leaves a summary
    assert not common.train_or_reuse(cfg, run_dir, None, log=lambda *_: None)["preempted"]  # trained again
    assert os.stat(metrics).st_mtime_ns != stamp
    os.remove(summary_path)  # as if killed before it finished
    redone = common.train_or_reuse(cfg, run_dir, None, log=lambda *_: None)
    assert redone["steps"] == 1 and os.path.isfile(os.path.join(run_dir, "summary.json"))


@pytest.mark.slow
def test_throughput_quick_end_to_end(tmp_path, capsys):
    """Measured rates for every concurrency and batch size, each over >= 2 timed calls, the fitted
    curves, and the report and plot that show them."""
    out = tmp_path / "tput"
    assert main(["experiment", "throughput", "--quick", "--out", str(out), "--pipeline-batch-sizes", "16", "32",
                 "--pipeline-updates", "3"]) == 0
    results = json.loads((out / "results.json").read_text())
    gen, learn = results["points"]["generation"], results["points"]["learner"]
    assert [p["concurrency"] for p in gen] == [1, 2, 4, 8]
    assert [p["batch_size"] for p in learn] == [16, 32, 64]
    for p in gen + learn:
        assert p["calls"] >= 2 and p["samples_per_second"] > 0 and p["tokens_per_second"] > 0
    # X(B) from real runs: each trained 3 updates at its batch size, the last one timed
    pipe = results["points"]["pipeline"]
    assert [p["batch_size"] for p in pipe] == [16, 32]
    for p in pipe:
        run = out / "runs" / f"pipeline-b{p['batch_size']}"
        steps = [m for m in read_metrics(str(run)) if "learner/train_seconds" in m]
        assert [m["batch_size"] for m in steps] == [p["batch_size"]] * 3
        assert p["updates_timed"] == 1 and p["samples_per_second"] > 0
        assert p["seconds_per_update"] == pytest.approx(steps[2]["wall_time"] - steps[1]["wall_time"])
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "Generation fit" in report and "Pipeline X(B)" in report


def test_throughput_measures_the_learner_with_packed_microbatches():
    # a config with learner.microbatch_tokens (the SmolLM2 one has 512) trains packed rows: the
    # experiment must lay the batch out as the run does (it built padded rows, and the packed loss
    # failed on them)
    from cadence.launch.experiments import throughput

    cfg = load_config(overrides=["learner.microbatch_tokens=64", "learner.microbatch_size=8"])
    points = throughput.measure(cfg, concurrencies=(1,), batch_sizes=(8, 16), repeats=1, min_seconds=0.0,
                                log=lambda *_: None)
    assert [p["batch_size"] for p in points["learner"]] == [8, 16]
    assert all(p["samples_per_second"] > 0 for p in points["learner"])


def test_throughput_pipeline_needs_three_updates(tmp_path, capsys):
    assert main(["experiment", "throughput", "--quick", "--out", str(tmp_path / "t"), "--concurrencies", "1",
                 "--batch-sizes", "8", "--pipeline-batch-sizes", "8", "--pipeline-updates", "2"]) == 2
    assert "pipeline_updates: must be >= 3" in capsys.readouterr().err


def test_the_smollm2_decision_rule_config_loads(tmp_path, monkeypatch):
    # benchmarks/configs/smollm2_decision_rule.yaml is meant to be rerun on a GPU: it must keep loading
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config([os.path.join(ROOT, "benchmarks", "configs", "smollm2_decision_rule.yaml")])
    assert cfg.model.path == str(tmp_path / ".cache" / "cadence" / "smollm2-135m-instruct")
    assert (cfg.task.name, cfg.task.max_ops, cfg.learner.batch_size // cfg.learner.group_size) == ("word_problems", 1, 4)
    # the synchronous setting layers on it (docs/results/smollm2_decision_rule_sync.md)
    sync = load_config([os.path.join(ROOT, "benchmarks", "configs", name)
                        for name in ("smollm2_decision_rule.yaml", "smollm2_decision_rule_sync.yaml")])
    assert (sync.actors.max_staleness, sync.learner.skip_zero_advantage, sync.learner.share_prompts,
            sync.task.heldout_size) == (0, True, True, 256)
    assert sync.learner.batch_size == cfg.learner.batch_size and sync.learner.optimizer == cfg.learner.optimizer
