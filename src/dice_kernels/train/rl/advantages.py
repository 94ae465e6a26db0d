"""Group-relative advantages: each task's rewards z-scored over its group of rollouts with the
population std; a group whose rewards are all equal carries no signal and is dropped (and counted)."""

from __future__ import annotations

from dataclasses import dataclass

ZERO_STD = 1e-8  # a group whose std is below this has no variance


@dataclass(frozen=True)
class Advantages:
    values: list[float]  # per rollout, in input order; 0.0 for rollouts of dropped groups
    kept: list[bool]  # per rollout: its group has variance, so it is trained on
    groups: int
    dropped_groups: int


def group_advantages(rewards: list[float], groups: list[str]) -> Advantages:
    """Z-score `rewards` within each group (rollouts sharing a key in `groups`, e.g. the task id)."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group keys")
    members: dict[str, list[int]] = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    values, kept, dropped = [0.0] * len(rewards), [False] * len(rewards), 0
    for idx in members.values():
        group = [rewards[i] for i in idx]
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / len(group)) ** 0.5  # population std, as DICE
        if std < ZERO_STD:
            dropped += 1
            continue
        for i in idx:
            values[i], kept[i] = (rewards[i] - mean) / std, True
    return Advantages(values=values, kept=kept, groups=len(members), dropped_groups=dropped)
