"""Process group and sharding: one code path for 1 CPU process, 1 GPU, N GPUs and N nodes. Every run has a process
group (torchrun's environment, or a single-process one) and every model is FSDP2-sharded (`fully_shard` per decoder
layer, then the root), with bf16 mixed precision on CUDA and optional activation checkpointing."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dice_kernels.train.config import ParallelConfig


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> Dist:
    """Join torchrun's process group (RANK / WORLD_SIZE / LOCAL_RANK set), or make a one-process group, so the rest
    of the trainer never branches on "distributed or not". nccl on CUDA, gloo on CPU. Idempotent."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    # Rollouts (a large KV cache) and the update (activations, optimizer state) alternate in one process: with
    # fixed segments the update of an SDAR-4B step on an H100 found 32.8 GiB reserved but unallocated, the rollouts'
    # freed blocks, and ran out of memory; with expandable segments it ran. Read when CUDA first allocates, so it
    # must be set before; a user's own PYTORCH_CUDA_ALLOC_CONF wins.
    if use_cuda:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend, device_id = ("nccl", dev) if use_cuda else ("gloo", None)
        if "WORLD_SIZE" in os.environ:  # started by torchrun (or another launcher that sets the env)
            dist.init_process_group(backend, device_id=device_id)
        else:  # a plain `dice train ...`: a group of one, with an in-memory store (no port, no network)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def shutdown() -> None:
    """Leave the process group, once the run's work has returned (run_loop.run_on_ranks)."""
    # What the run left in reference cycles (FSDP's modules and hooks, which hold the process group) is freed now,
    # while the interpreter is whole: left to finalization, its teardown aborted a gloo rank after its work was
    # done ("terminate called without an active exception": 3 in 100 two-rank runs of tests/e2e/test_rl_run.py's
    # worker on a loaded 2-core machine without the collection, none in 220 with it)
    gc.collect()
    if dist.is_initialized():
        # No rank tears its group down while another still talks to it: on a loaded machine a gloo rank that left
        # early aborted its peer ("terminate called without an active exception").
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def param_dtype(cfg: ParallelConfig, device: torch.device) -> torch.dtype:
    """The dtype forward and backward compute in (master weights and optimizer state stay fp32)."""
    choice = cfg.mixed_precision
    if choice == "auto":
        choice = "bfloat16" if device.type == "cuda" else "float32"
    return getattr(torch, choice)


def attention_backend(cfg: ParallelConfig, device: torch.device) -> str:
    """flex on CUDA (compiled, no L x L mask); dense SDPA on CPU, where PyTorch's flex attention has no backward."""
    if cfg.attention != "auto":
        return cfg.attention
    return "flex" if device.type == "cuda" else "dense"


def parallelize(model: nn.Module, layers: nn.ModuleList, cfg: ParallelConfig, device: torch.device,
                forward_methods: tuple[str, ...] = ()) -> nn.Module:
    """Shard `model` in place over all ranks: each of `layers` is one FSDP2 unit (optionally activation-
    checkpointed), the root holds the rest (embeddings, final norm, lm_head, tied or not).

    Parameters stay fp32 (master copy); on CUDA they are all-gathered in bf16 and gradients reduced in fp32.
    `forward_methods` are methods other than `forward` that run the model (e.g. `hidden_states`) and so must
    trigger FSDP's all-gather too. Works on a meta-device model (then `to_empty` and load or init the weights).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    compute = param_dtype(cfg, device)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for i, layer in enumerate(layers):
        if cfg.activation_checkpointing:
            # checkpoint_wrapper keeps state-dict names unchanged (its hooks strip the wrapper prefix)
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
            layers[i] = layer
        # The last layer's parameters are needed again first in backward: keeping them gathered saves a round trip.
        # On one rank nothing is sharded: "resharding" only frees the bf16 copy, and gathering it again for
        # backward is a cast of every weight (2 bytes a parameter kept instead; 46.9 vs 41.7 % MFU, docs/training.md).
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=world > 1 and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    return model


def all_reduce_sum(value: torch.Tensor | float, device: torch.device) -> float:
    """Sum a scalar over all ranks."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t)
    return float(t)


def barrier() -> None:
    dist.barrier()
