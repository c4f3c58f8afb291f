"""Expert parallelism: a 2-process run of the EP layer equals the one-process layer with the same
weights, rank by rank: outputs, dx, the router gradient summed over ranks, each rank's expert
gradients. gloo on CPU (localhost only); NCCL on 2 GPUs with the gpu marker.

Each rank routes its own tokens, so the reference is the one-process layer (all E experts) run on
each rank's tokens separately: its expert gradients summed over the ranks' tokens are what the EP
rank holding those experts must get, and the aux losses are per rank in both (Megatron-Core's
default: the load-balancing loss of a micro-batch's own tokens).
"""

import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moemlp.moe import MoE

WORLD = 2
TIMEOUT_S = 120  # the whole 2-process run; a hang fails the test instead of blocking CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A different number of tokens per rank; E = 6 over 2 ranks, 3 experts each.
SHAPE = dict(H=16, F=24, E=6, k=2, tokens=(13, 9))


def _full_weights(device, dtype):
    """Router and all experts' weights, drawn identically on every rank."""
    g = torch.Generator().manual_seed(1)
    H, F, E = SHAPE["H"], SHAPE["F"], SHAPE["E"]
    router = torch.randn(E, H, generator=g) * 0.3
    fc1 = torch.randn(E, 2 * F, H, generator=g) / H**0.5
    fc2 = torch.randn(E, H, F, generator=g) / F**0.5
    return router.to(device), fc1.to(device, dtype), fc2.to(device, dtype)


def _inputs(rank, device, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    T, H = SHAPE["tokens"][rank], SHAPE["H"]
    return torch.randn(T, H, generator=g).to(device, dtype), torch.randn(T, H, generator=g).to(device, dtype)


def _build(device, dtype, ep_group):
    router, fc1, fc2 = _full_weights(device, dtype)
    moe = MoE(hidden_size=SHAPE["H"], ffn_hidden_size=SHAPE["F"], num_experts=SHAPE["E"], top_k=SHAPE["k"], score="softmax", aux_loss_coeff=0.02,
              z_loss_coeff=0.005, expert_bias=True, ep_group=ep_group, device=device, dtype=dtype,
              backend="torch" if device.type == "cpu" else "auto")  # CUDA: the Triton kernels
    lo, n = moe.local_expert_offset, moe.num_local_experts
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe.experts.fc1_weight.copy_(fc1[lo : lo + n])
        moe.experts.fc2_weight.copy_(fc2[lo : lo + n])
        # Rank-independent bias that starves expert 5 for most tokens: an expert that receives
        # no rows from at least one rank.
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.35], device=device))
    return moe


def _run(moe, x, dy):
    x = x.clone().requires_grad_()
    y = moe(x)
    params = [moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight]
    grads = torch.autograd.grad(y, [x] + params, dy)
    return y.detach(), grads


def _worker(rank, port, device_type, dtype, errors):
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        _check_ep_equals_one_process(rank, device, dtype)
        _check_bad_ep_arguments()
        dist.barrier()  # both ranks done with every collective before either tears down
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    # Every check passed and the group is torn down. Leave without running C++ static destructors:
    # in ~5 % of CPU runs (torch 2.13, gloo) one of them aborted the finished process ("terminate
    # called without an active exception", faulthandler: no Python frame) after the worker had
    # returned, with a TCP or a file store and with a barrier before teardown.
    os._exit(0)


def _check_ep_equals_one_process(rank, device, dtype):
    ep = _build(device, dtype, dist.group.WORLD)
    assert ep.num_local_experts == 3 and ep.local_expert_offset == 3 * rank
    x, dy = _inputs(rank, device, dtype)
    y, (dx, d_router, d_fc1, d_fc2) = _run(ep, x, dy)

    ref = _build(device, dtype, None)
    y_ref, (dx_ref, _, _, _) = _run(ref, x, dy)
    sum_router = torch.zeros_like(d_router)
    sum_fc1 = torch.zeros_like(ref.experts.fc1_weight)
    sum_fc2 = torch.zeros_like(ref.experts.fc2_weight)
    starved = 0
    for r in range(WORLD):  # the reference on every rank's tokens, gradients summed
        xr, dyr = _inputs(r, device, dtype)
        _, (_, gr, g1, g2) = _run(ref, xr, dyr)
        starved += int(ref.router.tokens_per_expert[5] == 0)
        ref.router.tokens_per_expert.zero_()
        sum_router += gr
        sum_fc1 += g1
        sum_fc2 += g2
    assert starved >= 1, "test set-up: expert 5 should get no rows from some rank"

    dist.all_reduce(d_router)  # what data-parallel gradient reduction does
    # Same rows meet the same weights in both runs; only the batching differs (GEMM blocking, and
    # the order in which weight gradients sum rows from the two ranks): float64 agrees to
    # rounding, fp32 to fp32 accumulation in another order.
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    lo, n = ep.local_expert_offset, ep.num_local_experts
    torch.testing.assert_close(d_fc1, sum_fc1[lo : lo + n], **tol)
    torch.testing.assert_close(d_fc2, sum_fc2[lo : lo + n], **tol)
    # The router is fp32 whatever the experts' dtype; summed in another order on one process.
    torch.testing.assert_close(d_router, sum_router, rtol=1e-5, atol=1e-7)

    # Aux-loss-free balancing: counts summed over the group give the same bias on every rank.
    ep.router.update_expert_bias(0.01, group=dist.group.WORLD)
    gathered = [torch.empty_like(ep.router.expert_bias) for _ in range(WORLD)]
    dist.all_gather(gathered, ep.router.expert_bias)
    assert torch.equal(gathered[0], gathered[1])


def _check_bad_ep_arguments():
    with pytest.raises(ValueError, match="num_experts: must be divisible by the ep_group size 2"):
        MoE(hidden_size=8, ffn_hidden_size=8, num_experts=5, top_k=2, ep_group=dist.group.WORLD)


def _spawn(device_type, dtype):
    port = _free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(port, device_type, dtype, errors), nprocs=WORLD,
                               join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"EP run did not finish within {TIMEOUT_S} s")
    except mp.ProcessRaisedException as e:
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        pytest.fail("\n".join(msgs) or str(e))
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()


def test_ep_gloo_equals_one_process():
    _spawn("cpu", torch.float64)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ep_nccl_equals_one_process():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    _spawn("cuda", torch.float32)
