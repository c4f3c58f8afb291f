"""What the bench and precision jobs share: model shapes, routed problems, timing, output files."""

from __future__ import annotations

import csv
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int  # H
    ffn: int  # F (per expert)
    experts: int  # E (local experts)
    top_k: int
    tokens: int
    skew: float = 0.0  # routing: expert e drawn with weight (e + 1)^-skew; 0 is uniform

    @property
    def rows(self) -> int:  # M, routed rows
        return self.tokens * self.top_k

    def flops(self, backward: bool) -> float:
        """GLU MLP: forward 6·M·H·F (FC1 2·M·H·2F + FC2 2·M·F·H); backward twice that."""
        fwd = 6.0 * self.rows * self.hidden * self.ffn
        return 3.0 * fwd if backward else fwd


# Four released models' expert shapes (H, F, E, top_k, tokens); deepseek-v3 is one rank of 8-way EP.
GPU_SHAPES = {
    s.name: s
    for s in (
        Shape("qwen3-30b-a3b", 2048, 768, 128, 8, 4096),
        Shape("mixtral-8x7b", 4096, 14336, 8, 2, 8192),
        Shape("deepseek-v3-ep8", 7168, 2048, 32, 8, 4096),
        Shape("gpt-oss-120b", 2880, 2880, 128, 4, 4096),
    )
}
# Small enough for a 2-core CPU in seconds, with the same structure: few large experts, many small.
CPU_SHAPES = {s.name: s for s in (Shape("cpu-small", 256, 128, 8, 2, 256), Shape("cpu-fine", 128, 64, 16, 4, 128))}


def default_shapes(device: torch.device) -> dict[str, Shape]:
    return GPU_SHAPES if device.type == "cuda" else CPU_SHAPES


def all_shapes() -> dict[str, Shape]:
    return {**GPU_SHAPES, **CPU_SHAPES}


def parse_shape(spec: str) -> Shape:
    """A shape from ``H,F,E,TOP_K,TOKENS`` with an optional ``:SKEW`` (e.g. ``4096,1536,64,6,8192:1.2``):
    hidden size, per-expert FFN size, experts, experts a token, tokens, and the routing's skew (expert
    e drawn with weight (e + 1)^-SKEW, 0 uniform). A ValueError names what is wrong."""
    sizes, _, skew_s = spec.partition(":")
    parts = sizes.split(",")
    names = ("H", "F", "E", "TOP_K", "TOKENS")
    if len(parts) != len(names):
        raise ValueError(f"a shape is H,F,E,TOP_K,TOKENS[:SKEW] (5 integers), got {spec!r}")
    try:
        H, F, E, top_k, tokens = (int(v) for v in parts)
    except ValueError:
        raise ValueError(f"a shape is H,F,E,TOP_K,TOKENS[:SKEW] with integer sizes, got {spec!r}") from None
    for name, v in zip(names, (H, F, E, top_k, tokens)):
        if v < 1:
            raise ValueError(f"shape {spec!r}: {name} must be at least 1, got {v}")
    if top_k > E:
        raise ValueError(f"shape {spec!r}: TOP_K ({top_k}) cannot exceed E ({E}): a token's experts are distinct")
    skew = 0.0
    if skew_s:
        try:
            skew = float(skew_s)
        except ValueError:
            raise ValueError(f"shape {spec!r}: SKEW must be a number, got {skew_s!r}") from None
        if not (0.0 <= skew <= 16.0):  # also refuses nan
            raise ValueError(f"shape {spec!r}: SKEW must lie in [0, 16], got {skew_s}")
    name = f"h{H}-f{F}-e{E}-k{top_k}-t{tokens}" + (f"-skew{skew:g}" if skew else "")
    return Shape(name, H, F, E, top_k, tokens, skew)


def routed_problem(shape: Shape, device, dtype=torch.bfloat16, probs_dtype=torch.float32, seed=0):
    """Random top-k routing: each token picks top_k distinct experts, uniformly or, with
    ``shape.skew``, expert e with weight (e + 1)^-skew (Gumbel top-k: sampling without replacement
    in proportion to the weights); rows grouped by expert.

    Returns x (M, H), splits (E,), probs (M,), fc1_weight (E, 2F, H), fc2_weight (E, H, F), dy.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(shape.tokens, shape.experts, generator=g)
    if shape.skew:
        gumbel = -torch.log(-torch.log(scores.clamp_min(1e-20)))
        scores = gumbel - shape.skew * torch.log(torch.arange(1, shape.experts + 1, dtype=torch.float32))
    choice = scores.topk(shape.top_k, dim=1).indices
    splits = torch.bincount(choice.flatten(), minlength=shape.experts)
    M, H, F, E = shape.rows, shape.hidden, shape.ffn, shape.experts

    def r(*s, scale):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    x = r(M, H, scale=1.0)
    fc1_weight = r(E, 2 * F, H, scale=H**-0.5)
    fc2_weight = r(E, H, F, scale=F**-0.5)
    probs = torch.rand(M, generator=g).to(device=device, dtype=probs_dtype)
    dy = r(M, H, scale=1.0)
    return x, splits.to(device), probs, fc1_weight, fc2_weight, dy


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one measured call: the median and the spread of ``n`` samples."""

    median: float
    p10: float
    p90: float
    n: int

    @property
    def spread(self) -> float:
        """(p90 − p10) / median: 0.05 is a steady measurement, 0.3 a noisy one."""
        return (self.p90 - self.p10) / self.median if self.median > 0 else 0.0


def _quantile(sorted_times: Sequence[float], q: float) -> float:
    i = min(len(sorted_times) - 1, max(0, round(q * (len(sorted_times) - 1))))
    return sorted_times[i]


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms=25, rep_ms=100) -> Timing:
    """Timing of ``fn()``: triton's do_bench (device events, every sample) on a GPU, a host clock on
    the CPU (at least 5 samples, up to 50 within ``rep_ms``)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    else:
        warm_until = time.perf_counter() + warmup_ms / 1e3
        fn()  # warm-up: at least one call, and warmup_ms of them
        while time.perf_counter() < warm_until:
            fn()
        times = []
        deadline = time.perf_counter() + rep_ms / 1e3
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(float(t) for t in times)
    return Timing(statistics.median(times), _quantile(times, 0.1), _quantile(times, 0.9), len(times))


def median_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms=25, rep_ms=100) -> float:
    """The median of ``time_ms``."""
    return time_ms(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms).median


def bracketed_ms(fn: Callable[[], object], ref: Callable[[], object], device: torch.device, *,
                 rep_ms=100) -> tuple[float, float]:
    """(median ms of ``fn``, of ``ref``), ``ref`` timed just before and just after ``fn`` and its two
    medians averaged: a ratio of the two then carries no clock drift between a reference timed once
    and a kernel timed later (the GPU's clocks move with its temperature and power over seconds)."""
    before = time_ms(ref, device, rep_ms=rep_ms).median
    t = time_ms(fn, device, rep_ms=rep_ms).median
    after = time_ms(ref, device, rep_ms=rep_ms).median
    return t, (before + after) / 2


_SLEEP_CYCLES_PER_MS: dict[int, float] = {}


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on ``device``, measured once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_MS:
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # the kernel's first launch out of the way
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS[index] = cycles / start.elapsed_time(end)
    return _SLEEP_CYCLES_PER_MS[index]


def gpu_time_ms(fn: Callable[[], object], device: torch.device, *, iters: int = 20, warmup: int = 3) -> float:
    """Median GPU time of ``fn()`` with the host's launch time hidden, or NaN off a GPU.

    A call timed alone from an empty queue counts the host's time too: the GPU waits while Python
    and the launchers enqueue each kernel. In a model of many layers the host runs ahead and that
    time overlaps the GPU's work on earlier layers. Here each sample first queues a sleep kernel
    longer than ``fn``'s host time, then the start event, then ``fn()``: when the GPU reaches the
    start event every kernel of ``fn`` is queued, and the sample is the kernels' time back to back.
    A host synchronisation inside ``fn`` waits out the sleep and exposes the host again, so the
    result is never below the GPU's work; it is at most the wall time of ``fn`` alone."""
    if device.type != "cuda":
        return float("nan")
    host = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        host = max(host, (time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize(device)
    sleep_cycles = int((2.0 * host + 2.0) * _sleep_cycles_per_ms(device))
    times = []
    for _ in range(iters):
        torch.cuda._sleep(sleep_cycles)
        times.append(event_ms(fn))
    return statistics.median(times)


def event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one ``fn()`` between two CUDA events on the current stream (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def fwd_and_fwd_bwd(fn, leaves, dy, device: torch.device, rep_ms: int) -> tuple[Timing, Timing]:
    """Timings of ``fn()`` under no_grad, and of ``fn()`` plus autograd.grad of ``leaves`` with ``dy``."""
    with torch.no_grad():
        fwd = time_ms(fn, device, rep_ms=rep_ms)
    return fwd, time_ms(lambda: torch.autograd.grad(fn(), leaves, dy), device, rep_ms=rep_ms)


def fwd_and_fwd_bwd_ms(fn, leaves, dy, device: torch.device, rep_ms: int) -> tuple[float, float]:
    """Median ms of ``fwd_and_fwd_bwd``."""
    fwd, fwd_bwd = fwd_and_fwd_bwd(fn, leaves, dy, device, rep_ms)
    return fwd.median, fwd_bwd.median


def saved_bytes_per_row(fn: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor], rows: int) -> float:
    """Bytes autograd keeps for backward per routed row, beyond the tensors in ``exclude``
    (inputs and parameters); each storage counted once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values()) / rows


def write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def print_table(rows: list[dict], columns: Sequence[str], title: str) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if (abs(v) < 1e-2 and v != 0) else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return str(v)

    cells = [[fmt(r.get(c, "-")) for c in columns] for r in rows]  # "-": not measured for that row
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {_triton_version()}"
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, triton {_triton_version()}"


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"
