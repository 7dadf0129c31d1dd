"""Fixtures of the Ray tests: a real two-node Ray cluster in a private network namespace (only
loopback: Ray listens on all interfaces), and a run directory whose launch is stopped at the end."""
import os
import shutil
import tempfile

import pytest

from cadence.launch.cluster.ray.local_cluster import LocalCluster, enter_private_network
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


@pytest.fixture
def run_dir():
    d = tempfile.mkdtemp(prefix="cadence-ray-")
    yield os.path.join(d, "run")
    stop_drivers()  # a failed test's launch, before its directory goes
    shutil.rmtree(d, ignore_errors=True)
