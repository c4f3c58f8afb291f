#!/usr/bin/env python3
"""Set-up and run, on a machine with only Python (>= 3.10) and pip.

    python3 dev.py bench      # python -m moemlp bench, then precision on the same shapes, in .venv
    python3 dev.py test       # the test suite in .venv, over up to 8 cores (pytest-xdist)
    python3 dev.py setup      # only create .venv and install

.venv is created with access to the system's site-packages, so a torch that is already installed
(e.g. a CUDA build on a GPU machine) is used as it is. Where no torch is importable, torch 2.13.0
(the CPU build) is installed first, so the package's loose `torch>=2.6` requirement pulls nothing
more. Extra arguments after the command go to pytest / the moemlp command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
TORCH_PIN = "torch==2.13.0"


def _run(cmd, **kw) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], **kw)


def _ok(cmd) -> bool:
    return subprocess.call([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0


def setup() -> None:
    if not PY.exists():
        if _run([sys.executable, "-m", "venv", "--system-site-packages", VENV]) != 0:
            raise SystemExit("could not create .venv")
    pip = [PY, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if not _ok([PY, "-c", "import torch"]):
        if _run([*pip, TORCH_PIN]) != 0:
            raise SystemExit(f"could not install {TORCH_PIN}")
    marker = VENV / ".moemlp-installed"
    stamp = str((ROOT / "pyproject.toml").stat().st_mtime)
    if not (marker.exists() and marker.read_text() == stamp and _ok([PY, "-c", "import moemlp, pytest"])):
        if _run([*pip, "-e", f"{ROOT}[test]"]) != 0:
            raise SystemExit("could not install moemlp[test]")
        marker.write_text(stamp)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("bench", "test", "setup"):
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    setup()
    if cmd == "setup":
        return 0
    if cmd == "test":
        # Side by side over the machine's cores (pytest-xdist, in moemlp[test]), at most 8: the Triton
        # interpreter children are single-threaded and take most of the suite's time.
        workers = str(min(8, os.cpu_count() or 1))
        return _run([PY, "-m", "pytest", "-q", "-n", workers, *rest], cwd=ROOT)
    rc = _run([PY, "-m", "moemlp", "bench", *rest], cwd=ROOT)
    # precision follows the plain bench only: --moe, --hf, --recipes and --parts are benches of their
    # own (the bench refuses abbreviations, so these are the only spellings).
    if rc == 0 and not {"--moe", "--hf", "--recipes", "--parts", "-h", "--help"} & set(rest):
        rc = _run([PY, "-m", "moemlp", "precision", *_precision_args(rest)], cwd=ROOT)
    return rc


def _precision_args(bench_args: list[str]) -> list[str]:
    """The bench arguments that precision takes too (--shape, --device, --backend, --out)."""
    shared = ("--shape", "--device", "--backend", "--out")
    out, i = [], 0
    while i < len(bench_args):
        arg = bench_args[i]
        name = arg.split("=", 1)[0]
        if name in shared:
            out.append(arg)
            if "=" not in arg and i + 1 < len(bench_args):
                out.append(bench_args[i + 1])
                i += 1
        elif name not in ("--peers", "--rep-ms"):
            raise SystemExit(f"dev.py bench: {arg!r} is not an argument of python -m moemlp bench")
        elif "=" not in arg:
            i += 1  # skip the value of --peers / --rep-ms
        i += 1
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
