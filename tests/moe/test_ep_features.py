"""Expert parallelism with the layer's features, over gloo on CPU (localhost), in one 4-process run
whose process groups give EP sizes 1 ({r}), 2 ({0,1}, {2,3}) and 4 (all):

- checkpoints across EP sizes (moemlp.moe.distributed): a state saved at one EP size and loaded at
  another gives the same model: the same expert tensors and the same outputs, 1 -> 4, 4 -> 2,
  4 -> 1, 2 -> 4, and from the ranks' plain state_dicts offline;
- replicated-gradient sync: EP training with ``sync_replicated_grads`` equals one-process training
  on all the ranks' tokens (losses summed) over several SGD-with-momentum steps, with shared
  experts and their gate, group-limited routing, routed scaling, the expert bias, aux losses and
  token dropping (capacity from each rank's own tokens, as the one process computes it per call) on.

float64 experts; the router and the shared gate are fp32 by design (their gradients are summed in
another order on one process than over the ranks).
"""

import math
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _ports import rendezvous_port
from moemlp.moe import MoE, full_state_dict, full_state_dict_from_shards, load_full_state_dict, sync_replicated_grads

WORLD = 4
TIMEOUT_S = 150  # the whole 4-process run; a hang fails the test instead of blocking CI
H, F_, E, K = 12, 10, 8, 3
STEPS = 4
LAYER = dict(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=K, score="sigmoid", num_groups=4, topk_groups=2,
             routed_scaling_factor=2.0, expert_bias=True, aux_loss_coeff=0.01, z_loss_coeff=0.001,
             num_shared_experts=2, shared_expert_ffn_hidden_size=6, shared_expert_gate=True,
             capacity_factor=0.8, dtype=torch.float64, backend="torch")


def _initial_model() -> MoE:
    """The one-process layer every run starts from, identical on every rank."""
    torch.manual_seed(0)
    moe = MoE(**LAYER)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(E, H, generator=g) * 0.4)
        moe.shared_expert_gate.weight.copy_(torch.randn(1, H, generator=g) * 0.3)
        moe.router.expert_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return moe


def _batch(step, rank):
    """Rank ``rank``'s tokens at ``step``: a different number of tokens per rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    T = 7 + 3 * rank
    return torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(T, H, generator=g, dtype=torch.float64)


def _ep_model(group) -> MoE:
    moe = MoE(**LAYER, ep_group=group)
    load_full_state_dict(moe, _initial_model().state_dict())
    return moe


def _assert_same_state(a, b, **tol):
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith("tokens_per_expert"):
            continue  # counts since the last bias update: this rank's tokens, not a model tensor
        torch.testing.assert_close(a[key], b[key], msg=lambda m, key=key: f"{key}: {m}", **tol)


def _check_checkpoints(rank, groups):
    ep1, ep2, ep4 = groups
    x, _ = _batch(0, rank)
    ref = _initial_model()
    # set-up: tokens are dropped (capacity from this rank's T) on some rank, else dropping is untested
    _, idx = ref.router(x)
    most = torch.bincount(idx.reshape(-1), minlength=E).max()
    drops = torch.tensor([int(most > math.ceil(x.shape[0] * K / E * 0.8))])
    dist.all_reduce(drops)
    assert int(drops) >= 1
    # 1 -> 4: the one-process state loaded on 4 ranks gives the one-process outputs.
    m4 = _ep_model(ep4)
    assert m4.num_local_experts == 2 and m4.local_expert_offset == 2 * rank
    torch.testing.assert_close(m4(x), ref(x), rtol=1e-12, atol=1e-12)

    # Give every rank's experts (and the replicated tensors, identically) new values, so that a
    # wrong shard order or a missing gather shows.
    with torch.no_grad():
        for p in m4.experts.parameters():
            p.add_(0.01 * (rank + 1))
        m4.router.weight.mul_(1.1)
    y4 = m4(x)
    full = full_state_dict(m4)  # 4 -> full layout
    assert full["experts.fc1_weight"].shape[0] == E
    torch.testing.assert_close(full["experts.fc1_weight"][2 * rank : 2 * rank + 2], m4.experts.fc1_weight,
                               rtol=0, atol=0)
    shards = [None] * WORLD
    dist.all_gather_object(shards, {k: v.clone() for k, v in m4.state_dict().items()})
    _assert_same_state(full_state_dict_from_shards(m4, shards), full, rtol=0, atol=0)

    for group in (ep2, ep1, None):  # 4 -> 2, 4 -> 1 (a group of one), 4 -> a layer without EP
        m = MoE(**LAYER, ep_group=group)
        load_full_state_dict(m, full)
        torch.testing.assert_close(m(x), y4, rtol=1e-12, atol=1e-12)
        _assert_same_state(full_state_dict(m), full, rtol=0, atol=0)

    # 2 -> 4
    m2 = MoE(**LAYER, ep_group=ep2)
    load_full_state_dict(m2, full)
    with torch.no_grad():
        m2.experts.fc2_weight.mul_(0.9)  # both halves of each pair change: the state differs from m4's
    y2 = m2(x)
    m4b = MoE(**LAYER, ep_group=ep4)
    load_full_state_dict(m4b, full_state_dict(m2))
    torch.testing.assert_close(m4b(x), y2, rtol=1e-12, atol=1e-12)

    with pytest.raises(ValueError, match="experts.fc1_weight expected 8 experts"):
        load_full_state_dict(m4b, m4.state_dict())  # a shard, not the full layout


def _train(model, group_ranks, my_rank, sync):
    """STEPS steps of SGD with momentum. EP (``sync=True``): this rank's tokens. One process
    (``sync=False``): every rank's tokens of the group, losses summed."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for r in ([my_rank] if sync else group_ranks):
            x, dy = _batch(step, r)
            (model(x) * dy).sum().backward()  # the aux losses ride along on the router's probs
        if sync:
            sync_replicated_grads(model)
        opt.step()
        model.router.update_expert_bias(0.01, group=model.ep_group)
    return model


def _check_training(rank, groups):
    for size, group in zip((1, 2, 4), groups):
        group_ranks = [r for r in range(WORLD) if r // size == rank // size]
        ep = _train(_ep_model(group), group_ranks, rank, sync=True)
        one = _train(_initial_model(), group_ranks, rank, sync=False)
        # fp32 router / gate gradients summed in another order: fp32 rounding, carried over the steps
        _assert_same_state(full_state_dict(ep), one.state_dict(), rtol=1e-5, atol=1e-7)
        x, _ = _batch(99, rank)
        torch.testing.assert_close(ep(x), one(x), rtol=1e-5, atol=1e-7)
        if size == 4:
            # Groups on ranks: 4 groups of 2 experts on 4 ranks, topk_groups = 2: each token's
            # experts lie on at most 2 ranks.
            _, idx = one.router(x)
            assert int(torch.nn.functional.one_hot(idx // 2, 4).amax(1).sum(-1).max()) <= 2
            # Without the sync the replicated parameters diverge from the one-process run.
            unsynced = _ep_model(group)
            opt = torch.optim.SGD(unsynced.parameters(), lr=0.05)
            xs, dys = _batch(0, rank)
            (unsynced(xs) * dys).sum().backward()
            opt.step()
            ref = _initial_model()
            opt = torch.optim.SGD(ref.parameters(), lr=0.05)
            for r in range(WORLD):
                xr, dyr = _batch(0, r)
                (ref(xr) * dyr).sum().backward()
            opt.step()
            assert not torch.allclose(unsynced.router.weight, ref.router.weight, rtol=1e-5, atol=1e-7)


def _check_average(rank, ep4):
    # average=True: every gradient of the layer divided by W, the experts' included.
    a, b = _ep_model(ep4), _ep_model(ep4)
    x, dy = _batch(0, rank)
    for m, avg in ((a, False), (b, True)):
        (m(x) * dy).sum().backward()
        sync_replicated_grads(m, average=avg)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad * WORLD, pa.grad, rtol=1e-12, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _worker(rank, port, errors):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        # Every rank creates every group, in the same order (new_group is collective).
        singles = [dist.new_group([r]) for r in range(WORLD)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups = (singles[rank], pairs[rank // 2], dist.group.WORLD)
        _check_checkpoints(rank, groups)
        _check_training(rank, groups)
        _check_average(rank, groups[2])
        with pytest.raises(ValueError, match="pad_to_capacity: one device only"):
            MoE(**dict(LAYER, pad_to_capacity=True), ep_group=dist.group.WORLD)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    os._exit(0)  # see tests/moe/test_ep.py: skip C++ static destructors that abort a finished gloo process


def test_ep_checkpoints_and_training_at_world_sizes_1_2_4():
    port = rendezvous_port()
    errors = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_worker, args=(port, errors), nprocs=WORLD, join=False, start_method="spawn")
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
