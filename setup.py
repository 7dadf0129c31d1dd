"""Installs the four rooms beneath one import name, `cadence` (see cadence/__init__.py).

The repository keeps protocols/, learner/, actors/ and launch/ at its top, where contributors
expect them; installed, they become cadence.protocols, cadence.learner, ... so Cadence claims no
generic top-level import names. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOMS = ("protocols", "learner", "actors", "launch")

packages = ["cadence"] + [f"cadence.{room}" for room in ROOMS]
packages += [f"cadence.{room}.{sub}" for room in ROOMS for sub in find_packages(room)]
setup(packages=packages, package_dir={"cadence": "cadence", **{f"cadence.{room}": room for room in ROOMS}})
