"""How the Triton kernel tests reach the interpreter on a machine without a GPU.

``@triton.jit`` reads TRITON_INTERPRET when a kernel is decorated (triton 3.9: triton/runtime/jit.py
checks ``knobs.runtime.interpret`` in the decorator), i.e. when moemlp.kernels is first imported.
Setting it inside the test process would switch every later test's kernels onto the interpreter,
so the CPU cases run in a child pytest with TRITON_INTERPRET=1 (as tests/kernels/test_quant.py
does), and the parent process only starts it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The CPU cases run in this process when it is the interpreter child.
RUN_CPU_CASES = INTERPRET and not torch.cuda.is_available()
# The parent of a CPU-only run starts the child.
START_CHILD = not INTERPRET and not torch.cuda.is_available()


def skip_repeated_lang_patches() -> None:
    """In an interpreter process: keep triton.language patched once a launch, not once a helper call.

    The interpreter patches triton.language onto its numpy builder when a kernel launch starts and
    restores it when the launch ends (``GridExecutor.__call__``), and patches it again, without
    restoring, at every call of a ``@triton.jit`` helper (``InterpretedFunction.__call__``), once a
    program: ``inspect.getmembers`` over tl, tl.tensor and tl.math each time, though the launch's
    patch is in place and no member is still a builtin to patch. That was ~38 % of an nvfp4 quantizer
    test's time (cProfile, triton 3.9). This skips a helper's patch while a launch's patch that covers
    the same language modules is active; every launch still patches and restores, so the kernels
    run the same interpreted code, and a helper whose module sees a language module that no earlier
    call of the launch patched still patches it. Does nothing where the interpreter is not laid out
    this way."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    original = getattr(ti, "_patch_lang", None)
    if original is None or getattr(original, "_moemlp_once", False):
        return
    active: list[set] = []  # the language modules patched since the launch in progress began

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    class Scope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            active.pop()
            self.scope.restore()

    def patch_lang(fn):
        mods = langs(fn)
        if active and mods <= active[-1]:
            return None  # a helper inside a launch, its modules patched already: the caller drops the scope
        scope = original(fn)
        if active:
            active[-1] |= mods
            return scope
        if not hasattr(scope, "restore"):
            return scope
        active.append(mods)
        return Scope(scope)

    patch_lang._moemlp_once = True
    ti._patch_lang = patch_lang


def _child_env(test_file: str) -> dict:
    here = os.path.dirname(os.path.abspath(test_file))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in sys.path if p])
    # The interpreter runs the kernels one numpy op at a time on one core; under pytest -n 2 two
    # children share the CI machine's 2 cores, and torch's OpenMP threads (2 each) spun against the
    # other child: two test_x_index.py children side by side took 90 s, 84 s on one thread each.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


_UNUSED_PLUGINS = ("hypothesispytest", "anyio", "benchmark", "xdist")


# (test file, cases passed, cases skipped) of every interpreter child this session ran: each child is
# one test in the parent's count, so conftest.py's terminal summary reports the cases inside.
CHILD_RESULTS: list[tuple[str, int, int]] = []


def run_file_interpreted(test_file: str, timeout: int = 600, keyword: str | None = None) -> None:
    """pytest ``test_file`` in a child process with TRITON_INTERPRET=1; fail with its output.
    ``keyword``: a ``pytest -k`` expression, so that a long file's cases can run in two children
    (two parent tests, which ``-n`` runs side by side)."""
    here = os.path.dirname(os.path.abspath(test_file))
    env = _child_env(test_file)
    select = ["-k", keyword] if keyword else []
    # Without the plugins no child test uses: they took 4 of a child's 9 s of start-up (hypothesis
    # alone 2 s), and the suite starts 13 such children.
    unused = [arg for name in _UNUSED_PLUGINS for arg in ("-p", f"no:{name}")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *unused, test_file, *select],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(here),
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) > 0, "the interpreter child ran no test:\n" + run.stdout[-2000:]
    skipped = re.search(r"(\d+) skipped", run.stdout)
    CHILD_RESULTS.append((os.path.basename(test_file), int(passed.group(1)), int(skipped.group(1)) if skipped else 0))


def run_check_interpreted(test_file: str, check: str, *args: str, timeout: int = 120) -> None:
    """``check(*args)`` of ``test_file``'s module in a child process with TRITON_INTERPRET=1 (the
    variable is read when the kernels are defined); fail with its output."""
    module = os.path.splitext(os.path.basename(test_file))[0]
    env = _child_env(test_file)
    code = (f"import _triton_env; _triton_env.skip_repeated_lang_patches(); "
            f"import {module} as t; t.{check}(*{list(args)!r})")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
