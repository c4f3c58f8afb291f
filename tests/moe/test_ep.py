"""Expert parallelism at world sizes 2, 4 and 8: gloo on the CPU (localhost only) in CI, NCCL on as
many GPUs with the gpu/multigpu markers. One spawn per world size runs every check:

- exactness: the EP layer equals the one-process layer with the same weights, rank by rank:
  outputs, dx, the router gradient summed over ranks, each rank's expert gradients, the aux and z
  losses. Each rank routes its own tokens, so the reference is the one-process layer (all E
  experts) run on each rank's tokens separately: its expert gradients summed over the ranks' tokens
  are what the EP rank holding those experts must get, and the aux losses are per rank in both
  (Megatron-Core's default: the load-balancing loss of a micro-batch's own tokens). Rank 1 has no
  tokens at all, and one expert gets no rows from some ranks.
- stability: a second forward + backward gives the same bits.
- a rank that raises before the row exchange: the others raise ExpertParallelError at once, and
  the group still works (the next forward is bitwise the first).
- a rank that raises after it (in its experts): the others fail with the group's timeout error
  instead of hanging (gloo only: NCCL's watchdog answers a timeout by aborting the process).
- clean exit: every rank tears its groups down and returns exit code 0 through the normal
  interpreter shutdown; the parent checks the exit codes.

Teardown. A gloo worker thread that drops the last reference to a finished all-to-all's work
object releases the Python tensors it held, which takes the GIL; if that happens while the main
thread is in interpreter shutdown, the thread is killed inside a noexcept destructor and the
process aborts ("terminate called without an active exception", ~3 % of 2-rank runs here; core:
~AsyncAlltoallWork <- ProcessGroupGloo::runLoop, main thread in Py_FinalizeEx). A group whose last
reference goes away joins its worker threads, so the cure is that the group is really gone when
destroy_process_group returns: no layer, autograd graph or traceback still holding it (hence the
dels and gc.collect()), and no function default holding it: torch.distributed.nn.functional's
``group=group.WORLD`` defaults do when it is first imported after init_process_group, which
torch._dynamo's import (moemlp's first grouped_mlp call) did; moemlp.moe.ep now imports it first.
The workers check that no gloo worker thread is left when destroy_process_group has returned.
"""

import gc
import os
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _ports import rendezvous_port
from moemlp.moe import MoE
from moemlp.moe.ep import ExpertParallelError

SPAWN_TIMEOUT_S = 240  # one whole spawn; a hang fails the test instead of blocking CI
GROUP_TIMEOUT_S = 120  # torch.distributed's per-collective timeout in the workers
FAIL_TIMEOUT_S = 5.0  # the group timeout under which a rank that fails mid-exchange is detected

# E = 8 over W = 2, 4, 8 ranks: 4, 2, 1 local experts. Tokens per rank: rank 1 has none.
H, F, E, K = 16, 24, 8, 2
TOKENS = (13, 0, 9, 7, 11, 5, 8, 3)


def _full_weights(device, dtype):
    """Router and all experts' weights, drawn identically on every rank."""
    g = torch.Generator().manual_seed(1)
    router = torch.randn(E, H, generator=g) * 0.3
    fc1 = torch.randn(E, 2 * F, H, generator=g) / H**0.5
    fc2 = torch.randn(E, H, F, generator=g) / F**0.5
    return router.to(device), fc1.to(device, dtype), fc2.to(device, dtype)


def _inputs(rank, device, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    T = TOKENS[rank]
    return torch.randn(T, H, generator=g).to(device, dtype), torch.randn(T, H, generator=g).to(device, dtype)


def _build(device, dtype, ep_group):
    router, fc1, fc2 = _full_weights(device, dtype)
    moe = MoE(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, score="softmax", aux_loss_coeff=0.02,
              z_loss_coeff=0.005, expert_bias=True, ep_group=ep_group, device=device, dtype=dtype,
              backend="torch" if device.type == "cpu" else "auto")  # CUDA: the Triton kernels
    lo, n = moe.local_expert_offset, moe.num_local_experts
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe.experts.fc1_weight.copy_(fc1[lo : lo + n])
        moe.experts.fc2_weight.copy_(fc2[lo : lo + n])
        # Rank-independent bias that starves the last expert for most tokens: an expert that
        # receives no rows from at least one rank.
        bias = torch.zeros(E, device=device)
        bias[-1] = -0.35
        moe.router.expert_bias.copy_(bias)
    return moe


def _run(moe, x, dy):
    x = x.clone().requires_grad_()
    y = moe(x)
    params = [moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight]
    grads = torch.autograd.grad(y, [x] + params, dy)
    return y.detach(), grads


def _check_ep_equals_one_process(rank, world, device, dtype):
    ep = _build(device, dtype, dist.group.WORLD)
    assert ep.num_local_experts == E // world and ep.local_expert_offset == rank * E // world
    x, dy = _inputs(rank, device, dtype)
    y, (dx, d_router, d_fc1, d_fc2) = _run(ep, x, dy)
    assert y.shape == (TOKENS[rank], H)

    ref = _build(device, dtype, None)
    y_ref, (dx_ref, _, _, _) = _run(ref, x, dy)
    aux_ref, z_ref = ref.router.aux_loss, ref.router.z_loss
    sum_router = torch.zeros_like(d_router)
    sum_fc1 = torch.zeros_like(ref.experts.fc1_weight)
    sum_fc2 = torch.zeros_like(ref.experts.fc2_weight)
    starved = 0
    for r in range(world):  # the reference on every rank's tokens, gradients summed
        xr, dyr = _inputs(r, device, dtype)
        _, (_, gr, g1, g2) = _run(ref, xr, dyr)
        starved += int(ref.router.tokens_per_expert[-1] == 0)
        ref.router.tokens_per_expert.zero_()
        sum_router += gr
        sum_fc1 += g1
        sum_fc2 += g2
    # From rank 1 (no tokens) at any world size; from ranks 2 and 3, which have tokens, from W = 4.
    assert starved >= 1, "test set-up: the last expert should get no rows from some rank"

    grads = (dx, d_router.clone(), d_fc1, d_fc2)  # this rank's, for the rerun below
    dist.all_reduce(d_router)  # what data-parallel gradient reduction does
    # Same rows meet the same weights in both runs; only the batching differs (GEMM blocking, and
    # the order in which weight gradients sum rows from the ranks): float64 agrees to rounding,
    # fp32 to fp32 accumulation in another order.
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    lo, n = ep.local_expert_offset, ep.num_local_experts
    torch.testing.assert_close(d_fc1, sum_fc1[lo : lo + n], **tol)
    torch.testing.assert_close(d_fc2, sum_fc2[lo : lo + n], **tol)
    # The router is fp32 whatever the experts' dtype; summed in another order on one process.
    torch.testing.assert_close(d_router, sum_router, rtol=1e-5, atol=1e-7)
    # The aux losses are the router's, on this rank's tokens: the same fp32 ops on the same logits.
    assert torch.equal(ep.router.aux_loss, aux_ref) and torch.equal(ep.router.z_loss, z_ref)

    # Stability: the same inputs again give the same bits, every gradient included (this rank's
    # router gradient, before any reduction).
    y2, grads2 = _run(ep, x, dy)
    assert torch.equal(y2, y)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))

    # Aux-loss-free balancing: counts summed over the group give the same bias on every rank.
    ep.router.update_expert_bias(0.01, group=dist.group.WORLD)
    gathered = [torch.empty_like(ep.router.expert_bias) for _ in range(world)]
    dist.all_gather(gathered, ep.router.expert_bias)
    assert all(torch.equal(b, gathered[0]) for b in gathered)
    return ep, x, dy


def _check_failure_before_exchange(rank, world, ep, x, dy):
    """The last rank's router raises: it re-raises its own error, every other rank gets an
    ExpertParallelError at once, and the next forward on every rank works, bit for bit."""
    y, grads = _run(ep, x, dy)
    failing = world - 1
    if rank == failing:
        def broken_router(tokens):
            raise ValueError("injected router failure")

        ep.router.forward = broken_router
    t0 = time.monotonic()
    expected = (ValueError, "injected router failure") if rank == failing else (ExpertParallelError, rf"\[{failing}\]")
    with pytest.raises(expected[0], match=expected[1]):
        ep(x.clone().requires_grad_())
    assert time.monotonic() - t0 < GROUP_TIMEOUT_S / 4, "the failure should be announced, not timed out"
    if rank == failing:
        del ep.router.forward  # the class's forward again
    y2, grads2 = _run(ep, x, dy)
    assert torch.equal(y2, y)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))


def _check_failure_after_exchange(rank, world, device, dtype, group):
    """The last rank's experts raise after the rows arrived: the others are in the combine's
    all-to-all and must fail with the group's timeout, not hang. The group is unusable afterwards."""
    ep = _build(device, dtype, group)
    failing = world - 1
    if rank == failing:
        def broken_experts(*args, **kwargs):
            raise RuntimeError("injected expert failure")

        ep.experts.forward = broken_experts
    x, _ = _inputs(rank, device, dtype)
    dist.barrier(group=group)  # under the long timeout: no rank is late to the exchanges below
    group.set_timeout(timedelta(seconds=FAIL_TIMEOUT_S))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ep(x)
    elapsed = time.monotonic() - t0
    if rank == failing:
        assert "injected expert failure" in str(info.value)
    else:
        assert not isinstance(info.value, ExpertParallelError)
        assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower(), str(info.value)
        assert elapsed < FAIL_TIMEOUT_S + 30, f"failed after {elapsed:.1f} s, the timeout is {FAIL_TIMEOUT_S} s"


def _check_bad_ep_arguments(world):
    with pytest.raises(ValueError, match=f"num_experts: must be divisible by the ep_group size {world}"):
        MoE(hidden_size=8, ffn_hidden_size=8, num_experts=world + 1, top_k=2, ep_group=dist.group.WORLD)


def _check_ranks_draw_different_experts(rank, world, device):
    # Ranks seed alike (the router replica must match); their expert shards must still differ, and
    # drawing again after the same seed must repeat them.
    def build():
        torch.manual_seed(0)
        return MoE(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_group=dist.group.WORLD,
                   device=device)
    moe = build()
    shards = [torch.empty_like(moe.experts.fc1_weight) for _ in range(world)]
    dist.all_gather(shards, moe.experts.fc1_weight.detach().contiguous())
    routers = [torch.empty_like(moe.router.weight) for _ in range(world)]
    dist.all_gather(routers, moe.router.weight.detach().contiguous())
    for r in range(1, world):
        assert torch.equal(routers[r], routers[0]), "the router replicas differ"
        assert not torch.equal(shards[r], shards[0]), f"ranks 0 and {r} drew the same experts"
    assert torch.equal(build().experts.fc1_weight, moe.experts.fc1_weight), "the same seed drew other experts"


def _check_ranks_that_disagree(rank, world, device):
    # Layers built differently, and inputs that need a gradient on some ranks only: a ValueError on
    # every rank, before any row moves, and the group stays usable.
    with pytest.raises(ValueError, match=r"built different MoE layers .*ffn_hidden_size \[8, 16"):
        MoE(hidden_size=H, ffn_hidden_size=8 * (1 + (rank > 0)), num_experts=E, top_k=K, ep_group=dist.group.WORLD,
            device=device)
    torch.manual_seed(0)
    moe = MoE(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_group=dist.group.WORLD, device=device,
              backend="torch" if device.type == "cpu" else "auto")
    x = torch.randn(5, H, device=device, requires_grad=rank == 0)
    with pytest.raises(ValueError, match=r"disagree on which inputs need a gradient .*\['x, probs', 'probs'"):
        moe(x)
    y = moe(x.detach().requires_grad_())  # the same layer and group, now in agreement
    y.sum().backward()


def _gloo_threads() -> list[str]:
    """Threads of this process that belong to a gloo process group (Linux names them)."""
    if not sys.platform.startswith("linux"):
        return []
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if "gloo" in n]


def _worker(rank, world, port, device_type, dtype, errors):
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # world ranks share the CI machine's cores
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        # A second group for the timeout check, created by every rank while all are healthy.
        doomed = dist.new_group(list(range(world))) if device_type == "cpu" else None
        ep, x, dy = _check_ep_equals_one_process(rank, world, device, dtype)
        _check_failure_before_exchange(rank, world, ep, x, dy)
        _check_bad_ep_arguments(world)
        _check_ranks_draw_different_experts(rank, world, device)
        _check_ranks_that_disagree(rank, world, device)
        del ep, x, dy
        dist.barrier()  # everything above is done everywhere before a rank stops answering
        if doomed is not None:
            _check_failure_after_exchange(rank, world, device, dtype, doomed)
        del doomed
        gc.collect()  # layers, graphs and tracebacks in reference cycles let go of the groups now
        dist.barrier()  # on the healthy default group, with its timeout
        dist.destroy_process_group()
        # The group's threads can stop shortly after destroy returns (8 ranks on 2 cores), so look for
        # up to 10 s.
        stop = time.monotonic() + 10
        while (left := _gloo_threads()) and time.monotonic() < stop:
            time.sleep(0.05)
        assert not left, f"gloo threads {left} outlived destroy_process_group by 10 s: the exit may abort"
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _spawn(world, device_type, dtype):
    port = rendezvous_port()
    errors = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, port, device_type, dtype, errors), nprocs=world,
                               join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs.processes]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                # A rank failed: the others would wait out their collectives' timeout. Give them a
                # moment to report their own errors, then stop them.
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs.processes) if p.is_alive()]
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        if msgs:
            pytest.fail("\n".join(msgs))
        if hung:
            pytest.fail(f"ranks {hung} of {world} did not finish within {SPAWN_TIMEOUT_S} s")
        # A rank that passed every check must also leave cleanly: no abort in teardown.
        codes = [p.exitcode for p in procs.processes]
        assert codes == [0] * world, f"exit codes {codes}"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.long(seconds=55)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ep_gloo_equals_one_process(world):
    _spawn(world, "cpu", torch.float64)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ep_nccl_equals_one_process(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    _spawn(world, "cuda", torch.float32)
