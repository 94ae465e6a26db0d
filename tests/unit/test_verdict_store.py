"""harness/store.py's verdict cache on its own: a kept verdict reads back whole; outcomes that depend on the moment are not kept;
the key follows the task, the program and the settings that decide verdicts, not the scheduling ones."""

from __future__ import annotations

from dice_kernels.harness import EvalConfig, candidate_from_text
from dice_kernels.harness.outcomes import EvalResult, Outcome
from dice_kernels.harness.store import VerdictCache, reused, verdict_context, verdict_key
from dice_kernels.tasks import task_from_code

TASK = task_from_code("import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
                      "def get_inputs():\n    return [torch.randn(4)]\ndef get_init_inputs():\n    return []\n",
                      id="t", name="identity", level=1)
PROGRAM = "```python\nclass ModelNew:\n    pass\n```"
PLATFORM = {"backend": "cpu", "hardware": "x", "cuda_arch": "", "torch_version": "2", "gpu_memory_gib": 0.0}


def test_a_kept_verdict_reads_back_under_the_new_names(tmp_path):
    cache = VerdictCache(tmp_path)
    first = EvalResult("t", "a", "sha-a", Outcome.VALUE_MISMATCH, max_abs_diff=0.5, wall_s=3.0)
    cache.put("k", first)
    for outcome in (Outcome.TIMEOUT, Outcome.MEMORY_ERROR, Outcome.CUDA_MEMORY_ERROR, Outcome.HARNESS_ERROR):
        cache.put(outcome.value, EvalResult("t", "a", "sha-a", outcome))
        assert cache.get(outcome.value) is None  # load-dependent or ours: decided again next time
    earlier = cache.get("k")
    assert earlier == first
    cand = candidate_from_text(PROGRAM, id="b")
    again = reused(earlier, TASK, cand)
    assert (again.candidate_id, again.candidate_sha256, again.duplicate_of) == ("b", cand.sha256, "a")
    assert again.max_abs_diff == 0.5 and again.wall_s == 0.0 and again.outcome is Outcome.VALUE_MISMATCH
    cache.close()


def test_the_key_follows_what_decides_a_verdict():
    cand = candidate_from_text(PROGRAM, id="a")
    settings = EvalConfig(backend="cpu").settings()

    def key(c=cand, settings=settings, platform=PLATFORM, harness="1") -> str:
        return verdict_key(TASK, c, verdict_context(settings, platform, harness))

    spaced = candidate_from_text(PROGRAM.replace("pass", "pass  # same tree"), id="b")
    assert key(spaced) == key()  # another id, a comment: the same program
    scheduling = EvalConfig(backend="cpu", cache_dir="/elsewhere", reuse_verdicts=True).settings()
    assert key(settings=scheduling) == key()
    assert key(settings=EvalConfig(backend="cpu", trials=2).settings()) != key()
    assert key(platform={**PLATFORM, "hardware": "y"}) != key()
    assert key(harness="2") != key()
