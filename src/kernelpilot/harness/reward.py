"""The milestone reward of a candidate: -1 broken or wrong, 1 correct, 2 beats eager, 3 beats eager and compile."""

from __future__ import annotations

from kernelpilot.results import EvalResult

DEFAULT_THRESHOLD = 1.05  # "faster" means more than 5% faster


def milestone_reward(
    *,
    built: bool,
    correct: bool,
    speedup_vs_eager: float | None,
    speedup_vs_compile: float | None,
    threshold: float = DEFAULT_THRESHOLD,
) -> int:
    """-1 unless built and correct; 1 correct; 2 speedup vs eager > threshold; 3 > threshold vs eager and compile.

    A missing speedup (not timed, or torch.compile failed on the problem) never counts as faster.
    """
    if not (built and correct):
        return -1
    if not _faster(speedup_vs_eager, threshold):
        return 1
    if not _faster(speedup_vs_compile, threshold):
        return 2
    return 3


def reward_of(eval_result: EvalResult, threshold: float = DEFAULT_THRESHOLD) -> int:
    """The milestone reward of a judged candidate.

    A result with no build step (a candidate without kernel sources) counts as built; correctness is the
    verifier's verdict, which includes its guards; speedups come only from a bench that succeeded. A verifier that
    failed itself (error kind "harness") gave no verdict, so the reward is -1 as well: callers tell that apart by
    the error kind (the agent's Verify text, RFT's "verifier-failed" filter, the RL warm-up's warning).
    """
    built = eval_result.build is None or eval_result.build.ok
    correct = eval_result.verify is not None and eval_result.verify.ok
    bench = eval_result.bench if eval_result.bench is not None and eval_result.bench.ok else None
    return milestone_reward(
        built=built,
        correct=correct,
        speedup_vs_eager=bench.speedup_vs_eager if bench else None,
        speedup_vs_compile=bench.speedup_vs_compile if bench else None,
        threshold=threshold,
    )


def _faster(speedup: float | None, threshold: float) -> bool:
    return speedup is not None and speedup > threshold
