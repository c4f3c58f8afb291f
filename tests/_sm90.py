"""Offline sm_90 compiles of the Triton kernels (no GPU needed): PTX, SASS and resource usage, so a
test can assert which tensor-core instructions a config uses and that nothing spills."""

from __future__ import annotations

import os
import subprocess

import pytest


def compile_sm90(
    kernel,
    constexprs: dict,
    pointers: dict,
    descriptors: dict | None,
    num_warps: int,
    num_stages: int,
    divisible: tuple[str, ...] = (),
) -> tuple[str, str, str]:
    """Compiles ``kernel`` (a JITFunction) for sm_90. Arguments not named in ``constexprs``: pointers
    get ``pointers[name]`` (default ``*fp32``), names ending in ``_desc`` ``descriptors[name]`` (or
    None as a constexpr when ``descriptors`` is None), the rest are i32 scalars except fp32 activation
    parameters and ``unit``. Pointers and N/K-like sizes are specialized as 16-divisible, as a launch
    on real shapes does, and so are the scalars named in ``divisible``. Returns (ptx, sass,
    cuobjdump -res-usage)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("triton ships no cuobjdump here")
    const = dict(constexprs)
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_desc"):
            if descriptors is None:
                const[name] = None
                sig[name] = "constexpr"
            else:
                sig[name] = descriptors[name]
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*fp32")
        elif name in ("p0", "p1", "p2", "unit"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    names = list(sig)
    sizes = ("N", "K", "N1", "stride_be", "stride_bn", "stride_asm") + tuple(divisible)
    aligned = [n for n in names if n.endswith("_ptr") or n in sizes]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if sig[n] != "constexpr"}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    sass, usage = _disassemble(cuobjdump, compiled.asm["cubin"])
    return compiled.asm["ptx"], sass, usage


def compile_gluon_sm90(kernel, signature: dict, constexprs: dict, divisible: tuple[str, ...], num_warps: int,
                       maxnreg: int) -> tuple[str, str, int]:
    """Compiles the Gluon kernel ``kernel`` for sm_90 with ``signature`` (every argument's type,
    "constexpr" for those in ``constexprs``), the arguments named in ``divisible`` specialized as
    16-divisible as a launch on real shapes does. Returns (sass, cuobjdump -res-usage, shared bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import _runtime

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("triton ships no cuobjdump here")
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    # Gluon kernels compile through GluonASTSource (the plain ASTSource gives the module no
    # ttg.num-warps, and the layouts of a warp-specialized region then fail to verify).
    src = _runtime.GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                             "maxnreg": maxnreg})
    sass, usage = _disassemble(cuobjdump, compiled.asm["cubin"])
    return sass, usage, compiled.metadata.shared


def _disassemble(cuobjdump: str, cubin: bytes) -> tuple[str, str]:
    """(SASS, resource usage) of a cubin, through triton's cuobjdump."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moemlp_sm90_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    return sass, usage


def wgmma_groups(sass: str, op: str) -> list[tuple[int, bool, int | None]]:
    """The wgmma groups of ``sass`` in program order, each a run of ``op`` instructions with no wait
    between them: (instructions, whether the first starts from zero (RZ, no accumulator input), the
    level of the first ``WARPGROUP.DEPBAR.LE gsb0`` after the group: 1 leaves it in flight, 0 waits
    for it)."""
    import re

    groups: list[list] = []
    open_group = None
    for line in sass.splitlines():
        if re.search(rf"\b{re.escape(op)}", line):
            if open_group is None:
                open_group = [0, "RZ, !UPT" in line, None]
                groups.append(open_group)
            open_group[0] += 1
        else:
            m = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", line)
            if m:
                if open_group is not None:
                    open_group[2] = int(m.group(1), 16)
                open_group = None
    return [tuple(g) for g in groups]


def check_products_in_flight(sass: str, op: str, per_step: int, chain: int, tail: bool) -> None:
    """The engine's promoted K loops (kernels/gluon/_engine._mainloop_promoted, _mainloop_scaled) as
    the two consumer warpgroups compile them: two products of ``chain`` steps of ``per_step`` ``op``
    a pair, unrolled, and an odd product, each product's first step from zero and every step left in
    flight by the wait after it (nothing serialized: a serialized loop waits for each wgmma), then,
    where ``tail``, a K that ends mid-product's one-step product, waited for."""
    groups = wgmma_groups(sass, op)
    one = [(per_step, j % chain == 0, 1) for j in range(3 * chain)] + ([(per_step, True, 0)] if tail else [])
    assert groups == 2 * one, groups


def loop_local_accesses(sass: str, innermost: bool = False) -> tuple[int, int]:
    """(STL / LDL inside the K loops, STL / LDL anywhere). A loop is a backward branch's span of the
    SASS within one partition; the K loops are those that issue wgmma and no TMA store (a tile loop
    holds the epilogue's stores; ``innermost``: only those holding no other, where a tile loop has no
    TMA store in it). The consumers' layout need not nest: a tile loop's head may follow its K loop."""
    import re

    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    def spans(lo, hi, word):
        return any(lo <= a <= hi and word in t for a, t in ins)

    # A span across a partition's setmaxnreg is no loop: it is a wait's retry stub (placed after all
    # the partitions) branching back into its partition.
    k_loops = [(lo, hi) for lo, hi in loops
               if spans(lo, hi, "GMMA") and not spans(lo, hi, "UTMASTG") and not spans(lo, hi, "USETMAXREG")]
    if innermost:  # a tile loop with no TMA store in it holds its K loop: only the K loop counts
        k_loops = [(lo, hi) for lo, hi in k_loops
                   if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in k_loops)]
    local = [a for a, t in ins if re.search(r"\b(STL|LDL)\b", t)]
    in_loops = [a for a in local if any(lo <= a <= hi for lo, hi in k_loops)]
    assert len(k_loops) >= 2, "no K loop found for each consumer"
    return len(in_loops), len(local)


def check_fp8_consumers(sass: str, usage: str, consumer_regs: int = 232, producer_regs: int = 40,
                        in_flight: int = 2, tile_spills: int = 0) -> None:
    """The engine's FP8 mainloop as its kernels compile it (kernels/gluon/_engine._mainloop_scaled):
    per consumer warpgroup one 128-deep product a step, BK / 32 = 4 e4m3 wgmma of m64n128k32 (QGMMA)
    from zero, two in flight (``check_products_in_flight``), or with one in flight (the weight
    gradients' ``_wgrad._mainloop``) one product in the loop, waited for; the consumers' and the
    producer's setmaxnreg; at most 168 registers at launch, no spills. ``tile_spills`` > 0 allows that many local-memory
    accesses outside the K loops (values reloaded once a tile), none inside them."""
    import re

    op = "QGMMA.64x128x32.F32.E4M3.E4M3"
    if in_flight == 2:
        check_products_in_flight(sass, op, 4, 1, False)
    else:
        assert wgmma_groups(sass, op) == 2 * [(4, True, 0)], wgmma_groups(sass, op)
    assert not re.search(r"HGMMA", sass)
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {producer_regs:#x}\b", sass)
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, {consumer_regs:#x}\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage
    if tile_spills:
        in_loops, total = loop_local_accesses(sass)
        assert in_loops == 0 and total <= tile_spills, f"{in_loops} local accesses in the K loops, {total} in all"
        return
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"


def op_counts(sass: str, *ops: str) -> dict[str, int]:
    """How many instructions of each SASS opcode in ``ops`` (any modifiers: "FMUL" counts FMUL.FTZ too)."""
    import re

    return {op: len(re.findall(rf"\b{op}\b", sass)) for op in ops}


def check_acc_scale(off: tuple[str, str], on: tuple[str, str], elements: int, fused: bool = False) -> None:
    """An engine kernel with its accumulator factor (ACC_SCALE) against the same kernel without it,
    ``off`` and ``on`` each (SASS, cuobjdump -res-usage): the factor loaded once by each of the two
    consumer warpgroups (two global loads more), then multiplied onto each of the ``elements``
    accumulator values that the consumers' code holds a thread (both partitions' SASS): one FMUL each,
    or with ``fused`` (a bias added next) the multiply and the add contracted into one FFMA each, as
    the Triton kernel compiles them; the tensor-core instructions unchanged, no register more in
    local memory, and at most 168 registers at launch."""
    import re

    ops = ("LDG", "FMUL", "FFMA", "FADD", "STL", "LDL")
    (sass_off, usage_off), (sass_on, usage_on) = off, on
    c_off, c_on = op_counts(sass_off, *ops), op_counts(sass_on, *ops)
    delta = {op: c_on[op] - c_off[op] for op in ops}
    assert delta["LDG"] == 2, delta
    expected = (0, elements, -elements) if fused else (elements, 0, 0)
    assert (delta["FMUL"], delta["FFMA"], delta["FADD"]) == expected, (delta, c_off)

    def mmas(sass):
        return [m.group(1) for m in re.finditer(r"\b([HQ]GMMA\.\S+)", sass)]

    assert mmas(sass_on) == mmas(sass_off)
    assert delta["STL"] <= 0 and delta["LDL"] <= 0, delta

    def usage(text, what):
        return int(re.search(rf"{what}:(\d+)", text).group(1))

    assert usage(usage_on, "LOCAL") <= usage(usage_off, "LOCAL"), (usage_on, usage_off)
    assert usage(usage_on, "REG") <= 168, usage_on


def bound_gluon_launch(monkeypatch, call) -> tuple[object, dict, dict]:
    """Runs ``call()`` (a launcher of kernels/gluon/_launch.py, on CPU tensors) with the launch caught
    before any device work; returns (the kernel, its positional arguments bound to the kernel's
    parameter names, the keywords). The launchers pass arguments by position (``_launcher.launch``),
    which an offline compile (its signature is by name) never checks. Asserts that the positional
    arguments and the constexpr keywords fill the signature exactly."""
    import contextlib

    import torch

    from moemlp.kernels.gluon import _compat, _launch

    seen = {}

    class Desc:  # a TMA descriptor: the tensor it was made from
        @staticmethod
        def from_tensor(t, block, layout):
            return ("desc", t)

    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, *args, **kw: seen.update(k=kernel, a=args, kw=kw))
    monkeypatch.setattr(_launch, "bind_context", lambda device: None)
    monkeypatch.setattr(_launch, "_num_sms", lambda index: 132)
    monkeypatch.setattr(_launch, "_index", lambda device: 0)
    monkeypatch.setattr(_compat, "TensorDescriptor", Desc)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    call()
    kernel, args, kw = seen["k"], seen["a"], seen["kw"]
    names = list(kernel.arg_names)
    constexprs = set(kw) - {"num_warps", "maxnreg"}
    assert len(args) + len(constexprs) == len(names), (len(args), sorted(constexprs), names)
    assert set(names[len(args):]) == constexprs, "the keywords are not the signature's trailing constexprs"
    return kernel, dict(zip(names, args)), kw
