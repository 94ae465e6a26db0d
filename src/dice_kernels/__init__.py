"""dice-kernels: block-diffusion LLMs that write CUDA kernels, and an evaluation harness nobody can game."""

__version__ = "0.1.0"
