"""The trust boundary: cheats that fool a judge running candidate code in its own process, and the verdicts the judge
must give once references, comparison, clock and baseline cache are out of the candidate's reach.

Each file in candidates/trust/ is a model_new.py for one problem in problems/ (its docstring says the attack). Its
workspace holds the suite's kernels (candidates/kernels/) and the trust candidates' helpers (candidates/trust/kernels/);
the C++ torch-compute cheats' workspaces add candidates/trust/kernels_cpp_compute/, so only their extension holds the
hidden torch calls. Timing cheats are judged end to end (`Judge.evaluate`: build, verify, bench) in one workspace of
big_relu whose model_new.py each case replaces; the others through `Judge.verify` with a build made once. Every case
gets a Judge of its own, so one cheat's leftovers in a long-lived process cannot decide another's verdict; the
cross-candidate test shares one Judge on purpose.

The names a verdict must carry are in the first table below, so a rename in the judge is a one-line change here.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PROBLEMS = HERE / "problems"
CANDIDATES = HERE / "candidates"
TRUST = CANDIDATES / "trust"

# ------------------------------------------------------------------------------------------ verdict names

MISMATCH = "mismatch"  # error_kind of a wrong answer
GUARD = "guard"  # error_kind of a failed guard
UNACCOUNTED_TIME = "unaccounted-time"  # guard: GPU work the timed window did not hold (side streams, work outside it)
TORCH_SYMBOLS = "torch-symbols"  # guard: the workspace's own objects call torch compute (undefined at::_ops symbols)
TORCH_COMPUTE = "torch-compute"  # guard: torch's kernels computed (part of) the answer
NO_CUSTOM_KERNEL = "no-custom-kernel"  # guard: no kernel of the workspace ran (or the traced runs showed none)
TIMED_CALL = "timed call"  # in the message of a mismatch found on a sampled timed call
SCALE = "scale"  # in the message of a mismatch hidden under atol (outputs far smaller than the tolerance)

# ------------------------------------------------------------------------------------------ the cases

SUITE_KERNELS = ("kernels",)  # candidates/kernels/: relu, scale_shift, row_softmax
TRUST_KERNELS = ("trust/kernels",)  # touch, fingerprint, noise_like, relu_unjoined (copied by candidate_workspace)
CPP_COMPUTE_KERNELS = ("trust/kernels_cpp_compute",)  # hidden_relu, hidden_matmul

# An ok verdict for a timing cheat must come with a time at least this share of the honest kernel's, measured by the
# same judge on the same problem: the cheats claim 5x to 100x less, honest runs differ by far less than 2x.
HONEST_TIME_SHARE = 0.5
# What the forging candidates write as eager and torch.compile baselines (candidates/trust/forges_*.py, daemon_*.py).
FORGED_MS = 25.0


@dataclass(frozen=True)
class TrustCase:
    candidate: str  # candidates/trust/<candidate>.py
    problem: str  # problems/<problem>.py
    error_kind: str | None  # None: the verdict is ok
    guards: frozenset[str] = frozenset()  # failing guards the verdict must name
    message: str = ""  # a piece of the verdict's message
    honest_time: bool = False  # an ok verdict must time the candidate's real work (see HONEST_TIME_SHARE)
    or_timed_mismatch: bool = False  # a mismatch found on a timed call is an equally right verdict
    cpp_compute: bool = False  # the workspace holds kernels_cpp_compute/ and is built with it
    why: str = ""  # how the fixed judge reaches the verdict


def case(candidate, problem, error_kind, guards=(), message="", **options) -> TrustCase:
    return TrustCase(candidate, problem, error_kind, frozenset(guards), message, **options)


# Judged with Judge.evaluate in the big_relu workspace: verify, then bench.
TIMING_CASES = [
    case("honest_big_relu", "big_relu", None, why="the yardstick: correct, timed"),
    case("idle_after_verify", "big_relu", MISMATCH, message=TIMED_CALL,
         why="timed calls get fresh inputs and a random sample is compared: the unwritten buffer is wrong"),
    case("idle_by_call_rate", "big_relu", None, honest_time=True, or_timed_mismatch=True,
         why="as idle_after_verify: however it tells timing apart, a sampled timed call is compared; since the judge "
         "draws each run's inputs itself, its calls never come back to back (H200, 07de0d3: ok at the honest time, "
         "0.134 ms), so it does the work it is timed for"),
    case("cached_while_timed", "big_relu", MISMATCH, message=TIMED_CALL,
         why="a timed run that launches nothing returns one tensor for fresh inputs: a sampled call is wrong"),
    case("patches_timer_later", "big_relu", MISMATCH, message=TIMED_CALL,
         why="its timer patch stays in the sandbox; the timed calls it answers with unwritten buffers are sampled"),
    case("memo_by_identity", "big_relu", None, honest_time=True, or_timed_mismatch=True,
         why="fresh inputs every timed call leave nothing to look up: the time is the kernel's; an input buffer "
         "rewritten in place (same id, pointer and version) makes the memo's answer stale, a sampled mismatch"),
    case("memo_by_fingerprint", "big_relu", None, honest_time=True, or_timed_mismatch=True,
         why="as memo_by_identity; a probe equal to an earlier input except a few elements gives a stale answer"),
    case("unwatched_side_stream", "big_relu", None, honest_time=True,
         why="a timed run ends with a device-wide synchronisation inside its window: the side stream's kernel is timed "
         "(had the sandbox's timer been patched instead, the judge's wall clock gives unaccounted-time)"),
    case("unwatched_side_stream_c", "big_relu", None, honest_time=True, why="as unwatched_side_stream"),
    case("patches_timer_honest", "big_relu", None, honest_time=True,
         why="the clock is in the trusted process: the patched timer in the sandbox times nothing the judge reports"),
    case("torch_compute_modes_disabled", "big_relu", None, honest_time=True,
         why="a profiler is on in every call of the candidate's process (tracing.py), not only in the profiled one: "
         "it never sees one off, so it always runs its own kernel"),
    case("torch_after_verify", "big_relu", GUARD, {TORCH_COMPUTE}, message="a timed call",
         why="the kernels of the checked timed runs are collected: torch's relu among them fails, though the op "
         "recorder was popped and the answers are right"),
    case("reports_quarter", "big_relu", GUARD, {UNACCOUNTED_TIME}, message="longer on the judge's clock",
         why="the sandbox's timer reports a quarter of each window: the judge's wall clock, with the inputs drawn and "
         "the L2 flushed on its side before the clock starts, sees the rest"),
    case("reports_most", "big_relu", GUARD, {UNACCOUNTED_TIME}, message="longer on the judge's clock",
         why="not stopped: see KNOWN_GAPS"),
    case("silences_the_trace", "big_relu", GUARD, {NO_CUSTOM_KERNEL}, message="traced timed runs launched 0 kernels",
         why="a process that hides its kernels from the trace hides all of them: traced runs that show no kernel "
         "fail (not yet run on a GPU when written)"),
]  # fmt: skip

# Judged with Judge.verify: the cheat shows in the trials.
VERIFY_CASES = [
    case("steals_expected_output", "relu", MISMATCH,
         why="no reference lives in the sandbox's frames: it falls back to copying its input"),
    case("steals_via_gc", "relu", MISMATCH, why="no _ReferenceRun in the sandbox's heap: it falls back to its input"),
    case("rewrites_reference", "relu", MISMATCH,
         why="the reference Model runs in the trusted process: zeros no longer agree with it"),
    case("patches_compare", "relu", MISMATCH, why="the comparison runs in the trusted process"),
    case("plain_wrong_relu", "relu", MISMATCH, why="the second candidate of the cross-candidate test, alone"),
    case("noise_softmax", "wide_softmax", MISMATCH, message=SCALE,
         why="outputs far below atol: the tolerance follows the reference's scale, and noise is far off that scale"),
    case("constant_softmax", "wide_softmax", MISMATCH, message=SCALE, why="as noise_softmax"),
    case("cpp_hidden_relu", "relu", GUARD, {TORCH_SYMBOLS}, cpp_compute=True,
         why="kernels_cpp_compute's object leaves at::_ops::relu::call undefined: torch compute in the binding"),
    case("cpp_hidden_matmul", "matmul", GUARD, {TORCH_SYMBOLS}, cpp_compute=True,
         why="at::_ops::matmul::call: a comment naming cublasLtMatmul( is no call of it"),
]  # fmt: skip

DAEMON = "daemon_rewrites_cache"
# Judged with Judge.evaluate in the big_relu workspace with a cache folder of their own: honest candidates whose
# reported speedups must not come from the baselines they forge.
FORGING_CASES = [
    case("forges_baselines", "big_relu", None,
         why="baselines are signed by the trusted process: forged ones are measured anew"),
    case("forges_baselines_json", "big_relu", None, why="as forges_baselines"),
    case(DAEMON, "big_relu", None,
         why="the sandbox's processes all end with it (its own cgroup or PID namespace); forged files are unsigned"),
]  # fmt: skip

# The first candidate of each pair patches process-wide and is honest; the second, judged next by the same Judge, is
# plainly wrong and must be found so.
CROSS_CANDIDATE_PAIRS = [
    ("patches_for_the_next", "plain_wrong_relu"),
    ("patches_torch_for_the_next", "plain_wrong_relu"),
]

ALL_CASES = TIMING_CASES + VERIFY_CASES + FORGING_CASES

# ------------------------------------------------------------------------------------------ workspaces


def _copy_kernels(ws_root: Path, folders: tuple[str, ...]) -> None:
    for folder in folders:
        for source in sorted((CANDIDATES / folder).glob("*")):
            if source.is_file():
                shutil.copyfile(source, ws_root / "kernels" / source.name)


@contextmanager
def trust_workspace(
    problem: str, candidate: str, *, cpp_compute: bool = False, suite_kernels: bool = True
) -> Iterator[Path]:
    """A temporary workspace for problems/<problem>.py holding candidates/trust/<candidate>.py and the kernels."""
    from kernelpilot.harness.judge import candidate_workspace

    with candidate_workspace(PROBLEMS / f"{problem}.py", TRUST / f"{candidate}.py") as ws_root:  # copies trust/kernels
        _copy_kernels(ws_root, (SUITE_KERNELS if suite_kernels else ()) + (CPP_COMPUTE_KERNELS if cpp_compute else ()))
        yield ws_root


def install(ws_root: Path, candidate: str) -> None:
    """Make candidates/trust/<candidate>.py the workspace's model_new.py, without what a previous case left there."""
    (ws_root / "daemon.pid").unlink(missing_ok=True)
    shutil.copyfile(TRUST / f"{candidate}.py", ws_root / "model_new.py")


def new_judge(cache_dir: Path | None = None):
    from kernelpilot.harness.judge import Judge, Timeouts

    return Judge("cuda", timeouts=Timeouts(build=900, verify=300, bench=600), cache_dir=cache_dir)


@pytest.fixture(scope="module")
def baseline_cache(tmp_path_factory) -> Path:
    """The module's baseline cache: eager and torch.compile are timed once for all timing cases."""
    return tmp_path_factory.mktemp("baselines")


@pytest.fixture(scope="module")
def big_relu_workspace() -> Iterator[Path]:
    """The big_relu workspace the timing cases are evaluated in, built once; its model_new.py changes per case."""
    with trust_workspace("big_relu", "honest_big_relu") as ws_root:
        yield ws_root


@pytest.fixture(scope="module")
def base_build(big_relu_workspace):
    """The suite's and the trust helpers' kernels, built in the big_relu workspace; verify cases load this library."""
    with new_judge() as judge:
        build = judge.build(big_relu_workspace)
    assert build.ok, build.error
    return build


@pytest.fixture(scope="module")
def cpp_compute_build():
    """The same kernels plus kernels_cpp_compute/, for the C++ torch-compute cheats."""
    with trust_workspace("relu", "cpp_hidden_relu", cpp_compute=True) as ws_root:
        with new_judge() as judge:
            build = judge.build(ws_root)
        assert build.ok, build.error
        yield build


@pytest.fixture(scope="module")
def honest_result(big_relu_workspace, base_build, baseline_cache):
    """honest_big_relu evaluated: the time an honest kernel takes, the timing cases' yardstick."""
    install(big_relu_workspace, "honest_big_relu")
    with new_judge(baseline_cache) as judge:
        result = judge.evaluate(big_relu_workspace)
    assert result.error_kind is None and result.bench is not None and result.bench.ok, result.message
    return result


# ------------------------------------------------------------------------------------------ verdicts


@dataclass
class Verdict:
    """What the assertions need of an EvalResult or a VerifyResult."""

    ok: bool
    error_kind: str | None
    failing_guards: set[str]
    text: str  # the verdict's message and its guards' messages
    candidate_ms: float | None = None
    eager_ms: float | None = None
    compiled_ms: float | None = None


def verdict_of(result) -> Verdict:
    from kernelpilot.results import EvalResult

    if not isinstance(result, EvalResult):
        findings = list(result.guards)
        return Verdict(result.ok, result.error_kind, _failing(findings), _text(result.message, findings))
    bench = result.bench
    findings = [*(result.verify.guards if result.verify is not None else []), *getattr(bench, "guards", [])]
    timed = bench if bench is not None and bench.ok else None
    return Verdict(
        ok=result.error_kind is None,
        error_kind=result.error_kind,
        failing_guards=_failing(findings),
        text=_text(result.message, findings),
        candidate_ms=timed.candidate.median_ms if timed and timed.candidate else None,
        eager_ms=timed.eager.median_ms if timed and timed.eager else None,
        compiled_ms=timed.compiled.median_ms if timed and timed.compiled else None,
    )


def _failing(findings) -> set[str]:
    return {finding.guard for finding in findings if finding.severity == "fail"}


def _text(message: str, findings) -> str:
    return " | ".join([message, *(finding.message for finding in findings)])


def assert_trust_verdict(verdict: Verdict, case: TrustCase, honest_ms: float | None = None) -> None:
    shown = (
        f"{case.candidate}: {verdict.error_kind or 'ok'} | guards {sorted(verdict.failing_guards)} | "
        f"candidate {verdict.candidate_ms} ms | {verdict.text}\n"
        f"  expected: {case.error_kind or 'ok'} {sorted(case.guards)} {case.message!r}: {case.why}"
    )
    print(shown)
    if case.error_kind is None and case.or_timed_mismatch and verdict.error_kind == MISMATCH:
        assert not verdict.ok and TIMED_CALL in verdict.text, shown
        return
    assert verdict.ok == (case.error_kind is None), shown
    assert verdict.error_kind == case.error_kind, shown
    assert case.guards <= verdict.failing_guards, shown
    assert case.message in verdict.text, shown
    if case.honest_time:
        assert honest_ms is not None and verdict.candidate_ms is not None, shown
        assert verdict.candidate_ms >= HONEST_TIME_SHARE * honest_ms, f"{shown}\n  honest_big_relu: {honest_ms} ms"


# ------------------------------------------------------------------------------------------ GPU tests


# Cheats the judge does not stop yet, each with why: strict, so the day one is stopped the suite says so.
_WALL_CLOCK_TOO_COARSE = (
    "the wall-clock check cannot resolve it yet: on an H200 (b21a505) a timed run's protocol cost 0.8-1.3 ms and the "
    "clean process's figure wandered by about 0.1 ms from one timing to the next, so the check allows 0.1 ms (or a "
    "tenth of the call) more: hiding 0.03 ms is within it (scripts/bench_unaccounted.py; BENCHMARKS.md)"
)
KNOWN_GAPS: dict[str, str] = {"reports_most": _WALL_CLOCK_TOO_COARSE}


def with_known_gaps(cases: list) -> list:
    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[c.candidate]))
            if c.candidate in KNOWN_GAPS else c for c in cases]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", with_known_gaps(TIMING_CASES), ids=lambda c: c.candidate)
def test_timing_cheat_gets_the_expected_verdict(big_relu_workspace, baseline_cache, honest_result, case):
    honest_ms = verdict_of(honest_result).candidate_ms
    install(big_relu_workspace, case.candidate)
    with new_judge(baseline_cache) as judge:
        result = judge.evaluate(big_relu_workspace)
    assert_trust_verdict(verdict_of(result), case, honest_ms)


@pytest.mark.gpu
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.candidate)
def test_cheat_gets_the_expected_verdict_in_verification(request, case):
    build = request.getfixturevalue("cpp_compute_build" if case.cpp_compute else "base_build")
    with trust_workspace(case.problem, case.candidate, cpp_compute=case.cpp_compute) as ws_root, new_judge() as judge:
        result = judge.verify(ws_root, build, trials=5)
    assert_trust_verdict(verdict_of(result), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in FORGING_CASES if c.candidate != DAEMON], ids=lambda c: c.candidate)
def test_forged_baselines_do_not_inflate_the_speedup(big_relu_workspace, base_build, tmp_path, monkeypatch, case):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(cache_dir))  # where the forging candidates write
    install(big_relu_workspace, case.candidate)
    with new_judge(cache_dir) as judge:
        result = judge.evaluate(big_relu_workspace)
    assert_baselines_not_forged(verdict_of(result), case, cache_dir)


def assert_baselines_not_forged(verdict: Verdict, case: TrustCase, cache_dir: Path) -> None:
    forged = sorted(p.name for p in (cache_dir / "baselines").glob("*.json"))
    print(f"{case.candidate}: eager {verdict.eager_ms} ms, compile {verdict.compiled_ms} ms; cache files {forged}")
    assert_trust_verdict(verdict, case)
    assert verdict.eager_ms is not None and verdict.eager_ms < FORGED_MS / 10, "the eager baseline is the forged one"
    assert verdict.compiled_ms is None or verdict.compiled_ms < FORGED_MS / 10, "the compile baseline is the forged one"


@pytest.mark.gpu
def test_a_daemon_started_by_a_candidate_does_not_outlive_the_judges_call(
    big_relu_workspace, base_build, tmp_path, monkeypatch
):
    case = next(c for c in FORGING_CASES if c.candidate == DAEMON)
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(cache_dir))
    install(big_relu_workspace, case.candidate)
    survivors: set[int] = set()
    try:
        with new_judge(cache_dir) as judge:
            result = judge.evaluate(big_relu_workspace)
            survivors |= _alive_after_grace(_announced_pids(big_relu_workspace, cache_dir))
        survivors |= _alive_after_grace(_processes_naming(str(cache_dir)))
        assert not survivors, f"the candidate's daemon outlived the judge's call: pids {sorted(survivors)}"
        assert_baselines_not_forged(verdict_of(result), case, cache_dir)
    finally:
        for pid in survivors | _processes_naming(str(cache_dir)):
            _kill(pid)


def _announced_pids(ws_root: Path, cache_dir: Path) -> set[int]:
    pids = set()
    for pid_file in (ws_root / "daemon.pid", cache_dir / "daemon.pid"):
        try:
            pids.add(int(pid_file.read_text()))
        except (OSError, ValueError):
            pass
    return pids


def _processes_naming(marker: str) -> set[int]:
    """Processes other than this one whose environment names `marker` (the judge's workers and their children)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def _alive_after_grace(pids: set[int], grace_s: float = 5.0) -> set[int]:
    """The pids still running (zombies excluded) after up to `grace_s` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = {pid for pid in pids if _running(pid)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kill(pid: int) -> None:
    if _running(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.gpu
@pytest.mark.parametrize("pair", CROSS_CANDIDATE_PAIRS, ids=lambda pair: pair[0])
def test_one_candidates_patches_do_not_judge_the_next(base_build, pair):
    patcher, wrong = pair
    with new_judge() as judge:
        with trust_workspace("relu", patcher) as ws_root:
            first = verdict_of(judge.verify(ws_root, base_build, trials=5))
        with trust_workspace("relu", wrong) as ws_root:
            second = verdict_of(judge.verify(ws_root, base_build, trials=5))
    print(f"{patcher} (honest, patches process-wide): {first.error_kind or 'ok'} | {first.text}")
    assert_trust_verdict(second, next(c for c in VERIFY_CASES if c.candidate == wrong))


# ------------------------------------------------------------------------------------------ without a GPU


def test_every_trust_candidate_file_has_a_case_and_says_its_attack():
    cased = [c.candidate for c in ALL_CASES] + [name for pair in CROSS_CANDIDATE_PAIRS for name in pair]
    assert len(set(c.candidate for c in ALL_CASES)) == len(ALL_CASES), "a candidate has two cases"
    assert {path.stem for path in TRUST.glob("*.py")} == set(cased)
    for candidate in set(cased):
        docstring = ast.get_docstring(ast.parse((TRUST / f"{candidate}.py").read_text()))
        assert docstring and len(docstring) > 40, f"{candidate}.py: the docstring must say the attack"
    for c in ALL_CASES:
        assert (PROBLEMS / f"{c.problem}.py").is_file(), c
        assert c.why, f"{c.candidate}: say how the fixed judge reaches the verdict"
    for folder in SUITE_KERNELS + TRUST_KERNELS + CPP_COMPUTE_KERNELS:
        assert list((CANDIDATES / folder).glob("*.cpp")), folder



# ------------------------------------------------------------------------------------------ compile only

# at::_ops entry points the bindings may call: allocation, as guards.ALLOWED_ATEN_OPS allows in forward.
ALLOCATION_OPS = ("empty", "empty_like", "empty_memory_format", "empty_strided", "zeros", "zeros_like", "full")


@pytest.mark.cuda_build
def test_the_hidden_torch_compute_shows_in_the_workspace_objects_undefined_symbols(tmp_path):
    """The evidence the torch-symbols guard reads: kernels_cpp_compute's object calls torch compute, the trust helpers'
    binding beside it (like the suite's bindings, left out to keep the compile short) only allocates."""
    from kernelpilot.build import build_workspace

    with trust_workspace("relu", "cpp_hidden_relu", cpp_compute=True, suite_kernels=False) as ws_root:
        build = build_workspace(ws_root, arch="9.0")
        assert build.ok, build.error
        computing = {obj.name: _torch_ops_called(obj) for obj in (ws_root / "build").glob("*.o")}
    hidden = computing.pop("hidden_torch_binding.cpp.o")
    assert {"relu", "matmul"} <= hidden
    assert all(ops <= set(ALLOCATION_OPS) for ops in computing.values()), computing


def _torch_ops_called(obj: Path) -> set[str]:
    """Names of the at::_ops operators an object file leaves undefined (calls into torch)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH")
    listing = subprocess.run([nm, "-C", "--undefined-only", str(obj)], capture_output=True, text=True, check=True)
    return {
        line.split("at::_ops::", 1)[1].split("::", 1)[0]
        for line in listing.stdout.splitlines()
        if "at::_ops::" in line
    }
