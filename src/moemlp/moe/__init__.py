"""The MoE layer: fp32 router, dispatch/combine on the device, expert parallelism.

Module map: router.py (Router, SharedExpertGate), dispatch.py (sort, capacity, permute/unpermute,
the one-device forward), _kernels.py (Triton gathers), ep.py (all-to-all and the expert-parallel
forward), layer.py (MoE), distributed.py (checkpoints across EP sizes, replicated-gradient sync).
"""

from .distributed import full_state_dict, full_state_dict_from_shards, load_full_state_dict, sync_replicated_grads
from .layer import MoE

__all__ = ["MoE", "full_state_dict", "full_state_dict_from_shards", "load_full_state_dict", "sync_replicated_grads"]
