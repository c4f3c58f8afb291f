"""Host time of one grouped-MLP forward + backward, by recipe: where the CPU's time goes when a
step is launch-bound (small experts).

    PYTHONPATH=src python3 benchmarks/profile_host.py [--shape qwen3-30b-a3b] [--recipes bf16,fp8_block_wcache]

Per recipe it prints the host time a step takes to enqueue (no synchronization inside the steps),
the GPU time of a step, the CUDA runtime / driver calls a step makes (launches, copies,
synchronizations: a device-to-host copy or a synchronize inside a step is a bug), and cProfile's
functions with the most time of their own and the most time under them, and the inclusive host
time of every function of moemlp's kernel layers and of every kernel's launch, timed by
wrappers; ``--launches`` also times each launch of a step four ways (``--out DIR`` also writes cProfile's stats, one file a recipe, for ``pstats``).
``fp8_block_wcache``: fp8_block with the weights quantized once before the steps (``quantize_weights``).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import inspect
import io
import os
import pstats
import time
from collections import Counter, defaultdict

import torch

from moemlp.bench.kernels import mlp_step


def host_and_gpu_ms(step, steps: int, windows: int = 7) -> tuple[float, float]:
    """Enqueue time of a step on the host, and the GPU time of a step from events around them:
    medians over ``windows`` windows of ``steps`` steps (the host's time spreads 10-20 % between
    windows on the H200 machine)."""
    hosts, gpus = [], []
    for _ in range(windows):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(steps):
            step()
        end.record()
        hosts.append((time.perf_counter() - t0) / steps * 1e3)
        torch.cuda.synchronize()
        gpus.append(start.elapsed_time(end) / steps)
    return sorted(hosts)[windows // 2], sorted(gpus)[windows // 2]


def runtime_calls(step, steps: int) -> Counter:
    """CUDA runtime / driver calls a step makes, by name (torch.profiler's CPU-side CUDA events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    calls: Counter = Counter()
    for ev in prof.key_averages():
        if ev.key.startswith(("cuda", "cu")) and not ev.key.startswith("cudaDeviceSynchronize"):
            calls[ev.key] += ev.count
    kernels = sum(1 for ev in prof.events() if str(ev.device_type).endswith("CUDA"))
    calls["(kernels on the GPU)"] = kernels
    return Counter({k: v / steps for k, v in calls.items()})


# Modules whose functions are timed: the kernel layers between the autograd function and the launches.
TIMED_MODULES = ("moemlp.kernels.mlp", "moemlp.kernels.operands", "moemlp.kernels.gluon._launch",
                 "moemlp.kernels.quant.api", "moemlp.kernels.gemm.launch", "moemlp._quantized_weights")


# The modules that launch kernels (each imports kernels/_launcher.launch by name).
LAUNCHING_MODULES = ("moemlp.kernels.gluon._launch", "moemlp.kernels.gemm.launch", "moemlp.kernels.quant.api",
                     "moemlp.moe._kernels")


class Timers:
    """Inclusive host time and calls of wrapped functions (a nested call counts in both)."""

    def __init__(self):
        self.ms = defaultdict(float)
        self.calls = Counter()
        self.on = False

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] += (time.perf_counter() - t0) * 1e3
                self.calls[name] += 1

        return timed

    def install(self):
        from moemlp.kernels import _launcher

        for modname in TIMED_MODULES:
            mod = importlib.import_module(modname)
            for attr, fn in list(vars(mod).items()):
                if inspect.isfunction(fn) and fn.__module__ == modname:
                    setattr(mod, attr, self.wrap(f"{modname.split('.')[-1]}.{attr}", fn))
        # Every launch of the package goes through kernels/_launcher.launch, imported by name into
        # the launcher modules: each module's name is replaced by one timed under the kernel's name.
        launch = _launcher.launch
        timers = self

        def timed_launch(kernel, grid, *args, **kw):
            if not timers.on:
                return launch(kernel, grid, *args, **kw)
            t0 = time.perf_counter()
            try:
                return launch(kernel, grid, *args, **kw)
            finally:
                name = f"launch {getattr(kernel, 'fn', kernel).__name__}"
                timers.ms[name] += (time.perf_counter() - t0) * 1e3
                timers.calls[name] += 1

        for modname in LAUNCHING_MODULES:
            importlib.import_module(modname).launch = timed_launch

    def table(self, steps: int, step_ms: float) -> str:
        lines = [f"{'ms a step':>10} {'calls':>6}  function (inclusive; a step {step_ms:.3f} ms under the timers)"]
        for name, ms in sorted(self.ms.items(), key=lambda kv: -kv[1]):
            lines.append(f"{ms / steps:10.3f} {self.calls[name] / steps:6.1f}  {name}")
        return "\n".join(lines)


def launch_costs(step, reps: int) -> list[tuple[str, float, float, float, float, int]]:
    """Each Triton launch of one step, timed four ways (µs a launch, no synchronization inside a
    loop): through JITFunction.run (``kernel[grid]``: binding, specialization, cache lookup,
    launcher); its lookup alone (``warmup=True``, nothing launched); the compiled kernel's launcher
    called directly with the bound arguments; moemlp's ``kernels/_launcher.launch``. Also the
    number of arguments."""
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.runtime.driver import driver

    from moemlp.kernels import _launcher

    recorded = []
    launches = {modname: importlib.import_module(modname).launch for modname in LAUNCHING_MODULES}

    def recorder(launch):
        def record(kernel, grid, *args, **kw):
            recorded.append((kernel, grid, args, dict(kw)))
            return launch(kernel, grid, *args, **kw)

        return record

    for modname, launch in launches.items():
        importlib.import_module(modname).launch = recorder(launch)
    try:
        step()
    finally:
        for modname, launch in launches.items():
            importlib.import_module(modname).launch = launch
    torch.cuda.synchronize()
    recorded = [r for r in recorded if isinstance(r[0], jit.JITFunction)]

    def per_call(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        us = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        return us

    rows = []
    for fn, args, grid, kwargs in recorded:
        kernel = fn.run(*args, grid=grid, warmup=True, **kwargs)
        params = inspect.signature(fn.fn).parameters
        bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        values = list(bound.arguments.values())
        g = tuple(grid) + (1, 1)
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)

        def direct(kernel=kernel, values=values, g=g, stream=stream):
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None,
                       knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)

        full = per_call(lambda fn=fn, args=args, grid=grid, kwargs=kwargs: fn[grid](*args, **kwargs))
        lookup = per_call(lambda fn=fn, args=args, grid=grid, kwargs=kwargs: fn.run(*args, grid=grid, warmup=True, **kwargs))
        ours = per_call(lambda fn=fn, args=args, grid=grid, kwargs=kwargs: _launcher.launch(fn, grid, *args, **kwargs))
        rows.append((fn.fn.__name__, full, lookup, per_call(direct), ours, len(values)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--recipes", default="bf16,fp8_block_wcache")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="host and GPU time a step only")
    p.add_argument("--launches", action="store_true", help="also each launch of a step, timed four ways")
    p.add_argument("--out", default=None, help="a folder for cProfile's stats (recipe.pstats)")
    args = p.parse_args()
    timers = Timers()
    timers.install()
    summary = []
    for name in args.recipes.split(","):
        cached = name == "fp8_block_wcache"
        recipe = None if name == "bf16" else "fp8_block" if cached else name
        step = mlp_step(args.shape, recipe, cached)
        for _ in range(5):
            step()
        host, gpu = host_and_gpu_ms(step, args.steps)
        if args.quick:
            print(f"== {args.shape} {name}: host {host:.3f} ms a step, GPU {gpu:.3f} ms a step", flush=True)
            summary.append((name, host, gpu, float("nan")))
            continue
        calls = runtime_calls(step, 3)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        prof.disable()
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            prof.dump_stats(os.path.join(args.out, f"{args.shape}_{name}.pstats"))
        timers.ms.clear()
        timers.calls.clear()
        timers.on = True
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        timed_ms = (time.perf_counter() - t0) / args.steps * 1e3
        torch.cuda.synchronize()
        timers.on = False
        print(f"\n== {args.shape} {name}: host {host:.3f} ms a step, GPU {gpu:.3f} ms a step", flush=True)
        for key, n in sorted(calls.items(), key=lambda kv: -kv[1]):
            print(f"{n:7.1f} a step  {key}")
        for order in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.top)
            lines = s.getvalue().splitlines()
            first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
            print(f"-- by {order} (over {args.steps} steps)")
            print("\n".join(line[:200] for line in lines[first:] if line.strip()))
        print(f"-- inclusive host time by function (over {args.steps} steps)")
        print(timers.table(args.steps, timed_ms))
        if args.launches:
            rows = launch_costs(step, 50)
            print("-- each launch of a step, µs: kernel[grid] / its lookup alone / compiled launcher directly / "
                  "moemlp's launch / arguments")
            for kname, full, lookup, direct, ours, n in rows:
                print(f"{full:8.1f} {lookup:8.1f} {direct:8.1f} {ours:8.1f} {n:4d}  {kname}")
            sums = [sum(r[i] for r in rows) for i in range(1, 5)]
            print("".join(f"{v:8.1f} " for v in sums) + "      a step")
        summary.append((name, host, gpu, calls["(kernels on the GPU)"]))
    print("\nrecipe              host ms  GPU ms  kernels a step")
    for name, host, gpu, k in summary:
        print(f"{name:18s} {host:8.3f} {gpu:7.3f} {k:8.1f}")


if __name__ == "__main__":
    main()
