"""Fixtures shared by every test room."""

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real-model fixture: SmolLM2-135M-Instruct as a float32 Hugging Face directory.

    Prepared by `python benchmarks/real_model.py prepare` (.ci/run does it first). Without it a test
    that asks for this fixture skips, saying how to prepare it; with CI set it fails instead, so CI
    cannot pass by skipping the real model.
    """
    from benchmarks.real_model import FixtureMissing, smollm2_dir

    try:
        return str(smollm2_dir())
    except FixtureMissing as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e}: .ci/run prepares it before the tests")
        pytest.skip(str(e))
