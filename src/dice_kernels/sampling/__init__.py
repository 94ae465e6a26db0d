"""Block-diffusion decoding: remasking strategies, the KV-cached batched decoder with its trajectory record, text
generation from a checkpoint, the KernelBench prompt and the `dice generate` command."""

from dice_kernels.sampling.decoder import Decoded, SamplingConfig, decode
from dice_kernels.sampling.generate import GenerationResult, Generator

__all__ = ["Decoded", "GenerationResult", "Generator", "SamplingConfig", "decode"]
