"""The launch-configuration search, the one the policy runs and `scripts/bench_policy.py` reproduces.

Every group starts at its first candidate (the expected best), which is timed first. Then each further candidate
is tried one group at a time, in the groups' order, with the other groups at their best so far. A try that got no
time (it broke the kernel or verified wrong) changes nothing; a faster one becomes the group's best.

The search ends early once the best time so far is within NEAR_SOL of speed-of-light (the roofline floor of the
problem's bytes and FLOPs): the tries left could win at most a few per cent, and each costs a turn (a build, a
verification and a timing, several seconds).

Nor does it try configurations of a group whose kernels took under MIN_SHARE of the first configuration's time
(from the first Profile's kernel list): making such a group infinitely fast would still win less than that.
Only groups whose every kernel is generated can be measured so; a cuBLASLt or cuDNN call is always searched.

The search only orders tries and keeps score: the caller times each one (the policy by replaying its Profile
results from the conversation, the script by judging a workspace), so both keep the same configuration.
"""

from __future__ import annotations

from collections.abc import Mapping

# The fraction of speed-of-light at which further launch configurations are not worth their turns.
NEAR_SOL = 0.9
# A group whose kernels take less of the candidate's time than this is not searched: the most it could win is less.
MIN_SHARE = 0.03


class LaunchSearch:
    """Which launch configuration to try next, and the fastest choice so far, per group (candidate indices)."""

    def __init__(self, candidate_counts: Mapping[str, int], first_ms: float | None, first_sol: float | None = None,
                 shares: Mapping[str, float] | None = None):  # fmt: skip
        """`candidate_counts`: each group's number of candidates, in the order to search them; `first_ms`: the time
        of every group at its first candidate, or None when that was not timed; `first_sol`: that time's fraction
        of speed-of-light (None: no roofline); `shares`: the fraction of that time spent in each group's kernels,
        for the groups where it is known."""
        self.best = {name: 0 for name in candidate_counts}
        self.best_ms = first_ms
        self.best_sol = first_sol if first_ms is not None else None
        small = {name for name, share in (shares or {}).items() if share < MIN_SHARE} if first_ms is not None else set()
        # Each group left out, with how many configurations it would have tried.
        self.skipped = {name: count - 1 for name, count in candidate_counts.items() if name in small and count > 1}
        self.tries = [(name, index) for name, count in candidate_counts.items() if name not in small
                      for index in range(1, count)]  # fmt: skip
        self.recorded = 0  # how many of `tries` have a result

    def next_try(self) -> tuple[str, int] | None:
        """(group, candidate index) to time next, or None when every try has a result or the best is near
        speed-of-light."""
        if self.near_sol:
            return None
        return self.tries[self.recorded] if self.recorded < len(self.tries) else None

    @property
    def near_sol(self) -> bool:
        """True when the best time so far is within NEAR_SOL of speed-of-light."""
        return self.best_sol is not None and self.best_sol >= NEAR_SOL

    def choice(self, group: str, index: int) -> dict[str, int]:
        """The candidate of every group for a try: `index` for `group`, the best so far for the others."""
        return {**self.best, group: index}

    def record(self, ms: float | None, sol: float | None = None) -> bool:
        """The time of the next try (None: not timed) and its fraction of speed-of-light; True when it is the
        fastest so far and was kept."""
        group, index = self.tries[self.recorded]
        self.recorded += 1
        if ms is None or (self.best_ms is not None and ms >= self.best_ms):
            return False
        self.best, self.best_ms, self.best_sol = self.choice(group, index), ms, sol
        return True
