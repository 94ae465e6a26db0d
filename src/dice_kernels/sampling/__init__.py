"""Block-diffusion decoding: remasking strategies, the KV-cached batched decoder with its trajectory record, text
generation from a checkpoint, the KernelBench prompt and the `dice generate` command. Names load on first use
(PEP 562), so registering `dice generate` does not import torch."""

import importlib

_HOME = {"Decoded": "decoder", "SamplingConfig": "decoder", "decode": "decoder", "GenerationResult": "generate",
         "Generator": "generate"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
