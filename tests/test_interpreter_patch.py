"""The interpreter children patch triton.language once a launch (_triton_env.skip_repeated_lang_patches):
kept from regressing, since it holds the CPU suite near a third shorter and a Triton that laid its
interpreter out differently would leave the shim doing nothing without a word."""

import pytest
import triton
import triton.language as tl

import _triton_env


@triton.jit
def _twice(v):
    return v * 2.0


@triton.jit
def _helpers_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    for _ in tl.static_range(4):
        v = _twice(v)
    tl.store(x_ptr + offs, v)


def check_one_patch_a_launch() -> None:
    """64 programs each call a jit helper 4 times: without the shim the interpreter patches the
    language at each of those 256 calls (4 module scans each), with it at the launch only."""
    import torch
    from triton.runtime import interpreter as ti

    scans = []
    scan = ti._patch_builtin

    def counting(*args, **kwargs):
        scans.append(1)
        return scan(*args, **kwargs)

    x = torch.arange(64 * 16, dtype=torch.float32)
    ti._patch_builtin = counting
    try:
        _helpers_kernel[(64,)](x, BLOCK=16)
    finally:
        ti._patch_builtin = scan
    assert torch.equal(x, torch.arange(64 * 16, dtype=torch.float32) * 16), "the kernel's values"
    assert 0 < len(scans) <= 16, f"{len(scans)} scans of triton.language in one launch of 64 programs"


@pytest.mark.skipif(not _triton_env.START_CHILD, reason="the interpreter children run on a CPU-only machine")
def test_interpreter_patches_the_language_once_a_launch():
    _triton_env.run_check_interpreted(__file__, "check_one_patch_a_launch")
