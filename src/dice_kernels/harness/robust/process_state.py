"""The process-wide state a candidate could tamper with, saved by the robust check before any candidate code runs
and compared after: the clocks and synchronisation entry points a timing attack would patch, and the backend
settings that change speed or precision for everything that runs after them."""

from __future__ import annotations

import time

import torch


def timers() -> dict[str, object]:
    """The clocks and synchronisation entry points a timing attack would patch."""
    ev = torch.cuda.Event
    return {"time.perf_counter": time.perf_counter, "time.perf_counter_ns": time.perf_counter_ns,
            "time.monotonic": time.monotonic, "time.monotonic_ns": time.monotonic_ns, "time.time": time.time,
            "time.time_ns": time.time_ns, "time.process_time": time.process_time,
            "torch.cuda.synchronize": torch.cuda.synchronize, "torch.cuda.Event": ev,
            "torch.cuda.Event.record": ev.record, "torch.cuda.Event.elapsed_time": ev.elapsed_time,
            "torch.cuda.Event.synchronize": ev.synchronize, "torch.cuda.current_stream": torch.cuda.current_stream,
            "torch.cuda.Stream.synchronize": torch.cuda.Stream.synchronize}


def restore_timers(saved: dict[str, object]) -> None:
    for name, value in saved.items():
        owner_path, attr = name.rsplit(".", 1)
        owner = {"time": time, "torch.cuda": torch.cuda, "torch.cuda.Event": torch.cuda.Event,
                 "torch.cuda.Stream": torch.cuda.Stream}[owner_path]
        setattr(owner, attr, value)


PRECISION_STATE = ("torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32",
                    "torch.get_float32_matmul_precision()",
                    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
                    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction")


def global_state() -> dict[str, str]:
    """Process-wide settings that change speed or precision for everything that runs after them."""
    b = torch.backends
    getters = {
        "torch.backends.cuda.matmul.allow_tf32": lambda: b.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": lambda: b.cudnn.allow_tf32,
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cudnn.benchmark": lambda: b.cudnn.benchmark,
        "torch.backends.cudnn.deterministic": lambda: b.cudnn.deterministic,
        "torch.backends.cudnn.enabled": lambda: b.cudnn.enabled,
        "torch.backends.mkldnn.enabled": lambda: b.mkldnn.enabled,
        "torch.get_num_threads()": torch.get_num_threads,
        "torch.get_num_interop_threads()": torch.get_num_interop_threads,
        "torch.get_default_dtype()": torch.get_default_dtype,
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled,
    }
    state = {}
    for name, get in getters.items():
        try:
            state[name] = str(get())
        except Exception as e:  # noqa: BLE001 - a backend missing from this build
            state[name] = f"unavailable ({type(e).__name__})"
    return state
