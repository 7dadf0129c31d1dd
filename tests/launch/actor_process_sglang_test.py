"""actors.engine=sglang with actor processes: what the config allows, what one `cadence actor` makes
of the run's config (its own servers), and what the supervisor tells each process. The real servers
run in tests/e2e/sglang_processes_test.py."""
import os

import pytest

from cadence.actors.config import ActorsConfig, SGLangConfig
from cadence.launch import config_loader
from cadence.launch.cluster.actor_process import local_sglang
from cadence.launch.config import Config
from cadence.launch.run import pipeline
from cadence.launch.cluster.supervisor import ActorSupervisor


@pytest.fixture
def no_python(monkeypatch):
    monkeypatch.delenv("CADENCE_SGLANG_PYTHON", raising=False)


def sglang_run(**actors) -> Config:
    return Config(actors=ActorsConfig(engine="sglang", **actors))


def test_actor_processes_may_drive_sglang_but_not_share_servers(monkeypatch):
    monkeypatch.setenv("CADENCE_SGLANG_PYTHON", "/some/python")
    ActorsConfig(engine="sglang", processes=2).validate()  # each launches its own
    ActorsConfig(engine="sglang", processes=1, sglang=SGLangConfig(urls=("http://h:1",), sync="disk")).validate()
    shared = SGLangConfig(urls=("http://h:1",), sync="disk")
    with pytest.raises(ValueError, match=r"^sglang.urls: with processes=2 every actor process would drive"):
        ActorsConfig(engine="sglang", processes=2, sglang=shared).validate()
    with pytest.raises(ValueError, match=r"^sglang.port: with processes=2"):
        ActorsConfig(engine="sglang", processes=2, sglang=SGLangConfig(port=30000)).validate()


def test_a_learner_that_launches_no_servers_needs_no_sglang_python(no_python):
    ActorsConfig(engine="sglang", num_actors=0).validate()  # only actors that join from other hosts
    with pytest.raises(ValueError, match="^sglang.launch_python:"):
        ActorsConfig(engine="sglang", processes=1).validate()  # its processes launch them on this host


def test_one_actor_process_sees_its_own_servers(monkeypatch, no_python):
    cfg = sglang_run(processes=2)  # the learner's config: validated where it has a python
    attached = local_sglang(cfg, ("http://gen-host:30000",))
    a = attached.actors
    assert a.sglang.urls == ("http://gen-host:30000",) and a.sglang.sync == "disk"  # restart is impossible
    assert (a.processes, a.num_actors) == (0, 1)
    config_loader.validate_tree(attached)  # valid here, though this host has no SGLang python
    with pytest.raises(ValueError, match=r"^actors.sglang.launch_python: .*--sglang-url"):
        local_sglang(cfg, ())
    monkeypatch.setenv("CADENCE_SGLANG_PYTHON", "/some/python")
    launched = local_sglang(cfg, ())
    assert launched.actors.sglang.urls == () and launched.actors.sglang.sync == "restart"
    config_loader.validate_tree(launched)
    # a broadcast goes from this process to the servers beside it, not from the learner's address
    dist = Config(actors=ActorsConfig(engine="sglang", processes=2, sglang=SGLangConfig(
        sync="distributed", dist_address="10.0.0.5", dist_trusted_network=True)))
    assert local_sglang(dist, ()).actors.sglang.dist_address == "127.0.0.1"


def test_a_restarted_process_removes_the_checkpoints_its_predecessor_exported(tmp_path):
    from cadence.launch.cluster.actor_process import _LocalFiles

    for name in ("v000003", "v000007", "jax-cache", "logs"):
        (tmp_path / "proc-0" / name).mkdir(parents=True)
    assert _LocalFiles("").get("proc-0", str(tmp_path)) == str(tmp_path / "proc-0")
    assert sorted(p.name for p in (tmp_path / "proc-0").iterdir()) == ["jax-cache", "logs"]
    temporary = _LocalFiles("")
    path = temporary.get("proc-1", "")
    temporary.cleanup()
    assert not os.path.exists(path)


def test_each_supervised_process_gets_its_own_work_dir_and_the_runs_servers(tmp_path):
    def args(actors):
        return pipeline._process_args(actors, str(tmp_path), "proc-1")

    assert args(ActorsConfig(processes=1)) == []  # the built-in engine needs none
    assert args(ActorsConfig(engine="sglang", processes=2)) == ["--work-dir", str(tmp_path / "sglang" / "proc-1")]
    one = ActorsConfig(engine="sglang", processes=1, sglang=SGLangConfig(urls=("http://h:1",), sync="disk",
                                                                        work_dir="/data/sg"))
    assert args(one) == ["--work-dir", "/data/sg/proc-1", "--sglang-url", "http://h:1"]
    sup = ActorSupervisor(1, "tcp://127.0.0.1:1", str(tmp_path), extra_args=lambda i: ["--work-dir", f"/w/{i}"])
    assert sup.command("proc-0")[-4:] == ["--id", "proc-0", "--work-dir", "/w/proc-0"]


def test_one_actor_process_of_a_run_evaluating_on_its_actors_builds(monkeypatch):
    # run.eval_on=actors is the learner's choice; the one-actor view of a process (no actor
    # processes of its own) must still validate, or the process could never join
    import dataclasses

    monkeypatch.setenv("CADENCE_SGLANG_PYTHON", "/some/python")
    cfg = sglang_run(processes=1)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, eval_on="actors"))
    config_loader.validate_tree(cfg)
    config_loader.validate_tree(local_sglang(cfg, ()))
