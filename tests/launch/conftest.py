"""Fixtures of the cluster tests: a real two-node Ray cluster, a real one-node SLURM cluster (each
in a private network namespace with only loopback: their daemons listen on all interfaces), and a
run directory whose launch is stopped at the end."""
import os
import shutil
import tempfile

import pytest

from cadence.launch.cluster.private_network import enter_private_network
from cadence.launch.cluster.ray.local_cluster import LocalCluster
from tests.launch.ray_cluster import stop_drivers


@pytest.fixture(scope="module")
def cluster():
    enter_private_network()
    with LocalCluster(cpus=2) as c:
        yield c


@pytest.fixture
def cluster_up(cluster):
    if cluster.worker is None or cluster.worker.poll() is not None:
        cluster.start_worker()  # an earlier test took the worker node away
    return cluster


@pytest.fixture(scope="module")
def slurm_cluster():
    from cadence.launch.cluster.slurm.local_cluster import LocalSlurm, available

    missing = available()
    if missing:
        message = f"SLURM is not installed ({missing}): apt-get install slurm-wlm munge"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    enter_private_network()
    with LocalSlurm() as c:
        yield c


@pytest.fixture
def run_dir():
    d = tempfile.mkdtemp(prefix="cadence-ray-")
    yield os.path.join(d, "run")
    stop_drivers()  # a failed test's launch, before its directory goes
    shutil.rmtree(d, ignore_errors=True)
