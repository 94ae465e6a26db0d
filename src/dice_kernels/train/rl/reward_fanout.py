"""Rewards fanned out over a Ray cluster (`reward.fanout = "ray"`, the optional `ray` extra): `RayEvaluator` keeps
N actors, each with one long-lived harness `Evaluator` (one GPU each on CUDA), shards a step's candidates by task,
and merges the results back in input order; the driver alone writes the results store. Ray does the cluster work."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from dice_kernels.harness import Candidate, EvalConfig, EvalResult, Evaluator
from dice_kernels.harness.config import usable_cpus
from dice_kernels.harness.progress import Progress
from dice_kernels.harness.process.sandbox import available_memory_bytes
from dice_kernels.harness.store import ResultStore
from dice_kernels.tasks import Task

INSTALL_HINT = "pip install 'dice-kernels[ray]'"


def import_ray():
    """The `ray` module, or a one-line ValueError naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"reward.fanout=ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def shard_by_task(task_ids: Sequence[str], shards: int) -> list[list[int]]:
    """Indices into `task_ids` for each of `shards` actors. A task's candidates stay together, so its reference
    runs on one actor and its duplicates are found there; tasks go largest first (then first seen) to the least
    loaded shard (then the lowest), so the assignment depends only on the input. Indices keep input order."""
    members: dict[str, list[int]] = {}
    for i, tid in enumerate(task_ids):
        members.setdefault(tid, []).append(i)
    load, out = [0] * shards, [[] for _ in range(shards)]
    for group in sorted(members.values(), key=lambda g: (-len(g), g[0])):
        s = min(range(shards), key=lambda k: (load[k], k))
        load[s] += len(group)
        out[s].extend(group)
    return [sorted(s) for s in out]


class EvaluatorActor:
    """One actor's harness `Evaluator`. Ray reserves CPUs but does not confine the process, so the evaluator's
    build jobs and host-memory budget are sized to the actor's share of the node: several actors on one node must
    not each plan for the whole machine."""

    def __init__(self, config: EvalConfig):
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        if cpus:
            share = min(1.0, cpus / usable_cpus())
            config = replace(config, build=replace(config.build, jobs=max(1, int(cpus * 5 / 4))))  # 1.25 a core, as BuildConfig
            available = available_memory_bytes()
            if config.scheduler.output_memory_gb <= 0 and available:  # the harness default: half of what is available
                config = replace(config, scheduler=replace(config.scheduler,
                                                           output_memory_gb=available / 2 * share / (1 << 30)))
        self.evaluator = Evaluator(config)

    def platform(self) -> dict:
        return dict(self.evaluator.platform.__dict__)

    def evaluate(self, pairs: list[tuple[Task, Candidate]]) -> list[EvalResult]:
        return self.evaluator.evaluate(pairs)

    def close(self) -> None:
        self.evaluator.close()


class RayEvaluator:
    """`harness.Evaluator`'s `evaluate` / `close` over `actors` Ray actors. `address`: "" is `ray.init()`'s
    default (RAY_ADDRESS, else a cluster `ray start` began on this machine, else a new local one), "auto" a running
    cluster only, or a cluster's address. A Ray session already initialised in this process is used as it is.
    `actors` 0: one per GPU of the cluster on CUDA, one per node on CPU."""

    def __init__(self, config: EvalConfig, actors: int = 0, address: str = "", start_timeout_s: float = 300.0):
        ray = import_ray()
        self.ray, self.config = ray, config
        self.owns_session = not ray.is_initialized()
        if self.owns_session:
            try:
                ray.init(address=address or None, include_dashboard=False, log_to_driver=True)
            except ConnectionError as e:
                raise ValueError(f"reward.ray_address={address!r}: no Ray cluster there ({e}); start one with "
                                 "`ray start --head`, or set reward.ray_address=\"\" for a local one") from None
        backend = config.resolved_backend()
        config = replace(config, backend=backend)  # every actor runs what the rollouts' prompts asked for
        total = ray.cluster_resources()
        gpus, cpus = int(total.get("GPU", 0)), int(total.get("CPU", 0))
        if backend == "cuda":  # one GPU each, and the node's CPUs shared among its GPUs for the builds
            n = actors or gpus
            options = {"num_gpus": 1, "num_cpus": max(1, cpus // max(gpus, n, 1))}
        else:  # one actor a node by default, with the cluster's CPUs shared out
            n = actors or sum(1 for node in ray.nodes() if node.get("Alive"))
            options = {"num_cpus": max(1, cpus // max(n, 1))}
        if n < 1 or n > (gpus if backend == "cuda" else cpus):
            self.close()
            raise ValueError(f"reward.ray_actors={n}: the Ray cluster has {gpus} GPU(s) and {cpus} CPU(s), too few "
                             f"for {n} {backend} evaluator(s) (one GPU or at least one CPU each)")
        # an actor that dies (a node lost, the OOM killer) comes back with a fresh evaluator and its shard is
        # scored again: scoring is idempotent
        remote = ray.remote(max_restarts=2, max_task_retries=2, scheduling_strategy="SPREAD", **options)
        self.actors = [remote(EvaluatorActor).remote(config) for _ in range(n)]
        try:  # Ray waits for resources without saying so: an actor no node can hold would hang the first step
            platforms = ray.get([a.platform.remote() for a in self.actors], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise ValueError(f"reward.ray_actors={n}: not every evaluator started within {start_timeout_s:.0f} s "
                             f"(each asks {options}); see `ray status` for the cluster's free resources") from None
        except ray.exceptions.RayActorError as e:  # its evaluator raised while starting: say what, not Ray's trace
            self.close()
            lines = [line for line in str(e).splitlines() if line.strip()]
            raise ValueError(f"a reward evaluator did not start on the Ray cluster: {lines[-1] if lines else e}") \
                from None
        self.platform = platforms[0]

    def evaluate(self, pairs: Sequence[tuple[Task, Candidate]], out_dir: str | Path | None = None,
                 resume: bool = False, progress: bool = False) -> list[EvalResult]:
        """Every pair's result, in input order. With `out_dir`, results go to `out_dir/results.sqlite` (written
        here, as each actor's shard comes back); with `resume`, pairs already there are not evaluated again."""
        store = ResultStore(Path(out_dir) / "results.sqlite") if out_dir is not None else None
        bar = Progress(len(pairs), enabled=True) if progress else None
        try:
            if store:
                store.set_meta("config", {k: str(v) for k, v in self.config.settings().items()})
                store.set_meta("platform", self.platform)
            done = store.finished() if store and resume else {}
            results: list[EvalResult | None] = [done.get((t.id, c.id, c.sha256)) for t, c in pairs]
            todo = [i for i, r in enumerate(results) if r is None]
            shards = shard_by_task([pairs[i][0].id for i in todo], len(self.actors))
            pending = {actor.evaluate.remote([pairs[todo[j]] for j in shard]): [todo[j] for j in shard]
                       for actor, shard in zip(self.actors, shards) if shard}
            while pending:
                (ready,), _ = self.ray.wait(list(pending), num_returns=1)
                for i, r in zip(pending.pop(ready), self.ray.get(ready)):
                    results[i] = r
                    if store:
                        store.put(r)
                    if bar:
                        bar.advance(r)
            return results
        finally:
            if bar:
                bar.close()
            if store:
                store.close()

    def close(self) -> None:
        """Each actor closes its evaluator (its workers and fork server end with it), then the actors go."""
        actors, self.actors = getattr(self, "actors", []), []
        if actors:
            self.ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=60)
        for actor in actors:
            self.ray.kill(actor)
        if self.owns_session:
            self.ray.shutdown()
