"""`PolicyView` (rollout.share_weights): rollouts decode on the FSDP model's own gathered weights, no copy. Against
`PolicySnapshot`'s copy on the CPU (fp32, gloo) and on a GPU (bf16 mixed precision, nccl, the compiled decoder with
CUDA graphs). Each test has its own process group (the device decides the backend)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import VOCAB, tiny_model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from dice_kernels.model.attention import Attention
from dice_kernels.sampling import SamplingConfig, decode
from dice_kernels.sampling.decoder import release_graphs
from dice_kernels.train.config import ParallelConfig
from dice_kernels.train.distributed import init_distributed, param_dtype, parallelize, shutdown
from dice_kernels.train.rl.trainer import PolicySnapshot, PolicyView

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def group(request):
    """A process group of one on the test's device: gloo on the CPU, nccl on CUDA."""
    dist = init_distributed(request.param)
    yield dist
    shutdown()


def _decodes_like_the_copy(dist, tied: bool, compile: bool) -> None:
    """The view decodes the copy's tokens on the gathered tensors themselves, before and after an optimizer step
    moves the weights; after its block the model is sharded again (the gathered tensors freed, fp32 shards in its
    state dict as a checkpoint wants) and the view holds no storage."""
    model = tiny_model(0, tie_word_embeddings=tied).to(dist.device).train()
    parallel = ParallelConfig(activation_checkpointing=True)
    dtype = param_dtype(parallel, dist.device)
    snapshot, view = PolicySnapshot(model, dtype, dist.device), PolicyView(model, dtype, dist.device)
    parallelize(model, model.model.layers, parallel, dist.device, forward_methods=("hidden_states",))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = SamplingConfig(max_new_tokens=16, steps=4, strategy="dynamic", threshold=0.3, temperature=1.0, seed=3,
                         compile=compile)
    prompts, stops = [[5, 6, 7, 8], [9, 10, 11, 12, 13]], [VOCAB + 1]
    decoded = []
    for _ in range(2):
        copied = decode(snapshot.refresh(model), prompts, cfg, stops).tokens
        release_graphs(snapshot.plain)
        with view.weights(model) as plain:
            gathered = {n.replace(_CHECKPOINT_PREFIX, ""): p for n, p in model.named_parameters()}
            assert all(p.data_ptr() == gathered[n].data_ptr() for n, p in plain.named_parameters())
            assert (plain.lm_head.weight is plain.model.embed_tokens.weight) == tied
            assert decode(plain, prompts, cfg, stops).tokens == copied
            release_graphs(plain)
        assert all(p.numel() == 0 for p in view.plain.parameters())
        assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded: the gathered copies freed
        state = model.state_dict()
        assert all(isinstance(v, DTensor) and v.dtype == torch.float32 for v in state.values()), state.keys()
        decoded.append(copied)
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(len(decoded))).to(dist.device)
        mask = torch.ones(2, 1, 12, 12, dtype=torch.bool, device=dist.device).tril()
        positions = torch.arange(12, device=dist.device).expand(2, 12)
        model(ids, positions, Attention(mask)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert decoded[0] != decoded[1]  # the second comparison is on moved weights


@pytest.mark.parametrize("group", ["cpu"], indirect=True)
@pytest.mark.parametrize("tied", [True, False])
def test_policy_view_decodes_the_copys_tokens_on_the_gathered_weights(group, tied):
    _decodes_like_the_copy(group, tied, compile=False)


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["cuda"], indirect=True)
@pytest.mark.parametrize("compile", [False, True])
def test_policy_view_on_a_gpu_decodes_like_the_copy(group, compile):
    """bf16 gathered by FSDP's mixed precision, read by eager or compiled decoding with CUDA graphs."""
    _decodes_like_the_copy(group, tied=True, compile=compile)
