"""Are two runs' compiled XLA programs the same? (a refactor must not change what runs)

    python benchmarks/hlo_compare.py dump DIR [train overrides...]   # a 3-update default run, HLO dumped to DIR
    python benchmarks/hlo_compare.py compare DIR_A DIR_B             # one JSON line

`dump` runs `cadence train` (run.steps=3 unless overridden) with XLA dumping every program it
compiles after optimization. `compare` keys each program by its jit name, drops what a refactor
may change without changing the program (metadata, the stack-frame tables of source locations,
module ids),
and compares the two multisets. To check a refactor, dump at the old commit (its own checkout) and
at the new one, then compare.
"""
from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

SUFFIX = ".cpu_after_optimizations.txt"
_METADATA = re.compile(r",? metadata=\{[^}]*\}")
_MODULE_LINE = re.compile(r"^HloModule \S+", re.M)
# The stack-frame tables (source files, functions, lines) that the metadata points into.
_FRAME_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*\n?", re.M)


def normalized(text: str) -> str:
    text = _FRAME_TABLES.sub("", _METADATA.sub("", text))
    return _MODULE_LINE.sub("HloModule _", text)


def programs(dump_dir: str) -> dict[str, collections.Counter]:
    """jit name -> Counter of normalized-program hashes (a name compiled for several shapes)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in glob.glob(os.path.join(dump_dir, "*" + SUFFIX)):
        name = os.path.basename(path)[: -len(SUFFIX)].split(".", 1)[1]  # module_0012.jit_x -> jit_x
        with open(path) as f:
            out[name][hashlib.sha256(normalized(f.read()).encode()).hexdigest()[:16]] += 1
    return out


def dump(dump_dir: str, overrides: list[str]) -> int:
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE",
               JAX_ENABLE_COMPILATION_CACHE="0")
    run_dir = tempfile.mkdtemp(prefix="hlo-run-")
    args = [f"run.dir={run_dir}", "run.steps=3", "run.jax_cache=none", *overrides]
    return subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], env=env).returncode


def compare(a: str, b: str) -> dict:
    pa, pb = programs(a), programs(b)
    if not pa or not pb:
        raise SystemExit(f"no *{SUFFIX} in {a if not pa else b}")
    differ = sorted(n for n in set(pa) | set(pb) if pa.get(n) != pb.get(n))
    return {"benchmark": "hlo_compare", "programs_a": sum(sum(c.values()) for c in pa.values()),
            "programs_b": sum(sum(c.values()) for c in pb.values()), "names": len(set(pa) | set(pb)),
            "differ": differ, "same": not differ}


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        sys.exit(dump(sys.argv[2], sys.argv[3:]))
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        result = compare(sys.argv[2], sys.argv[3])
        print(json.dumps(result))
        sys.exit(0 if result["same"] else 1)
    sys.exit(__doc__)
