"""Tests of loading problem files safely: the child process with its time and memory limits (through the real
`kernelpilot init` in a subprocess), the reuse of a check that passed, the size estimate on meta tensors, and the
host budget of the CPU fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernelpilot.errors import ProblemError
from kernelpilot.host_budget import HostBudget, HostBudgetExceeded
from kernelpilot.problem import load_problem, problem_id_of, validated_on_meta
from kernelpilot.problem_check import ProblemLimits, check_problem, parse_bytes
from kernelpilot.problem_size import LARGEST_GPU_BYTES, ProblemSize, measure, require_fits

SRC = Path(__file__).resolve().parents[2] / "src"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

HEADER = "import os, sys, time\nimport torch\nimport torch.nn as nn\n\n"
MODEL = '''
class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2
'''
GET_INPUTS = "\ndef get_inputs():\n    return [torch.randn(4, 8)]\n"
GET_INIT_INPUTS = "\ndef get_init_inputs():\n    return []\n"
VALID = HEADER + MODEL + GET_INPUTS + GET_INIT_INPUTS
FOUR_TIB = VALID.replace("torch.randn(4, 8)", "torch.randn(2**40)")  # 2**40 float32 values: 4 TiB

# Short limits, so a hang costs the tests seconds; the child's start-up (importing torch) is not counted.
TEST_TIMEOUT_S = 3
TEST_MEMORY = "1GiB"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A cache folder of the test's own (inherited by the processes it starts): no check is reused from another."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(folder))
    return folder


def counting_runs(runs: Path) -> str:
    """VALID, with a top level that appends a line to `runs` each time it runs."""
    return f"with open({str(runs)!r}, 'a') as runs:\n    runs.write('ran\\n')\n" + VALID


def write(folder: Path, text: str, name: str = "bad.py") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def with_body(function: str, body: str) -> str:
    """VALID with `function`'s body replaced by `body` (one line)."""
    if function == "__init__":
        old = "        super().__init__()\n"
        new = f"        super().__init__()\n        {body}\n"
    elif function == "get_inputs":
        old, new = GET_INPUTS, f"\ndef get_inputs():\n    {body}\n    return [torch.randn(4, 8)]\n"
    else:
        old, new = GET_INIT_INPUTS, f"\ndef get_init_inputs():\n    {body}\n    return []\n"
    assert old in VALID
    return VALID.replace(old, new)


def run_init(
    problem: Path, workspace: Path | None = None, **env: str
) -> tuple[subprocess.CompletedProcess, float, Path]:
    """`python -m kernelpilot init PROBLEM --dir WS` in its own process, with the test limits; its result, the seconds
    it took, and the workspace folder it was asked to make (default: ws beside the problem)."""
    workspace = workspace or problem.parent / "ws"
    environment = dict(os.environ)
    environment.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
        KERNELPILOT_PROBLEM_TIMEOUT=str(TEST_TIMEOUT_S),
        KERNELPILOT_PROBLEM_MEMORY=TEST_MEMORY,
        **env,
    )
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "init", str(problem), "--dir", str(workspace)],
        cwd=problem.parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,  # a hang fails the test here instead of stalling the suite
    )
    return completed, time.monotonic() - started, workspace


def refused(problem: Path, *phrases: str, **env: str) -> str:
    """Run init on `problem`; assert a non-zero exit, one error line holding every phrase, a hint, no traceback and
    no workspace; return the error line."""
    completed, _, workspace = run_init(problem, **env)
    lines = completed.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert completed.returncode != 0, completed.stderr
    assert "Traceback" not in completed.stderr
    assert len(errors) == 1, completed.stderr
    assert problem.name in errors[0]
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    assert any(line.startswith("hint:") for line in lines), completed.stderr
    assert not workspace.exists()
    return errors[0]


# --------------------------------------------------------------------------------- through the CLI


def test_a_valid_problem_is_initialised(tmp_path):
    """The same path as every refusal below, on a file that is fine: the limits do not refuse everything."""
    completed, _, workspace = run_init(write(tmp_path, VALID, name="good.py"))
    assert completed.returncode == 0, completed.stderr
    assert (workspace / "model.py").read_text() == VALID


@pytest.mark.parametrize(
    ("source", "stage"),
    [
        (VALID + "\nwhile True:\n    pass\n", "while running its top level"),
        (with_body("get_init_inputs", "while True: pass"), "in get_init_inputs()"),
        (with_body("__init__", "while True: pass"), "in Model(*get_init_inputs())"),
        (with_body("get_inputs", "while True: pass"), "in get_inputs()"),
        (VALID.replace("return x * 2", "while True: pass"), "in Model.forward() on meta tensors"),
    ],
    ids=["top-level", "get_init_inputs", "Model", "get_inputs", "forward"],
)
def test_an_endless_loop_times_out_naming_the_stage(tmp_path, source, stage):
    started = time.monotonic()
    refused(write(tmp_path, source), f"timed out after {TEST_TIMEOUT_S} s {stage}")
    # The loop is endless: returning at all shows the timeout, and this bound that nothing else waited long.
    assert time.monotonic() - started < 60


def test_os_exit_at_import_is_an_error_not_a_silent_success(tmp_path):
    refused(write(tmp_path, "import os\nos._exit(0)\n" + VALID), "exited with code 0 while running its top level")


def test_os_exit_in_get_inputs_names_the_code_and_stage(tmp_path):
    refused(write(tmp_path, with_body("get_inputs", "os._exit(5)")), "exited with code 5 in get_inputs()")


def test_sys_exit_in_get_inputs_names_the_code_and_stage(tmp_path):
    source = with_body("get_inputs", "print('the file talks'); sys.exit(3)")
    line = refused(write(tmp_path, source), "exited with code 3 in get_inputs()")
    assert "the file talks" not in line


def test_a_segfault_is_reported_with_the_signal_and_stage(tmp_path):
    source = with_body("get_init_inputs", "import ctypes; ctypes.string_at(0)")
    refused(write(tmp_path, source), "killed by SIGSEGV in get_init_inputs()")


def test_the_memory_limit_is_reported_with_the_limit(tmp_path):
    source = "import numpy\nBUFFER = numpy.ones(2**31, dtype=numpy.uint8)\n" + VALID  # 2 GiB, over the 1 GiB limit
    refused(write(tmp_path, source), "ran out of memory while running its top level", "1.0 GiB")


def test_a_four_tib_input_is_refused_with_the_numbers(tmp_path):
    refused(write(tmp_path, FOUR_TIB), "4.0 TiB of inputs", "4.0 TiB of outputs", "24.0 TiB")


def test_eval_of_a_problem_file_is_checked_too(tmp_path):
    """`eval FILE --candidate` makes a temporary workspace, through the same check."""
    problem = write(tmp_path, FOUR_TIB)
    candidate = write(tmp_path, "class ModelNew: pass\n", name="model_new.py")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
                       TORCH_CUDA_ARCH_LIST="9.0")  # (without it, eval --device cpu first says there is nothing to build for)
    completed = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "eval", str(problem), "--candidate", str(candidate), "--device", "cpu"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr
    assert [line for line in completed.stderr.splitlines() if line.startswith("error:")] == [
        "error: bad.py needs 24.0 TiB of GPU memory to be judged (3 x (4.0 TiB of inputs + 4.0 TiB of outputs) "
        "+ 2 x 0 B of parameters), more than any GPU has (268.2 GiB at most)."
    ]


def test_the_cpu_fallback_does_not_draw_a_16_gib_input(tmp_path):
    """get_inputs() uses .item(), so it cannot run on meta tensors; on the host it would need 16 GiB."""
    source = with_body("get_inputs", "n = int(torch.tensor(4).item())").replace(
        "return [torch.randn(4, 8)]", "return [torch.randn(n * 2**30)]"
    )
    started = time.monotonic()
    refused(write(tmp_path, source), "cannot run on meta tensors", "16.0 GiB", "1.0 GiB")
    assert time.monotonic() - started < 60  # drawing 16 GiB on this machine took minutes, or the OOM killer


def test_processes_the_file_starts_are_killed_with_it(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    source = (
        "import subprocess\n"
        f"SLEEPER = subprocess.Popen(['sleep', '600'])\nopen({str(pid_file)!r}, 'w').write(str(SLEEPER.pid))\n"
        + VALID
        + "\nwhile True:\n    pass\n"
    )
    refused(write(tmp_path, source), "timed out")
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper)


def test_a_process_that_escapes_the_group_and_holds_the_pipes_does_not_hang_the_load(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    source = (
        "import subprocess\n"
        "SLEEPER = subprocess.Popen(['setsid', 'sleep', '300'])\n"  # a new session: the group kill cannot reach it
        f"open({str(pid_file)!r}, 'w').write(str(SLEEPER.pid))\n" + VALID
    )
    started = time.monotonic()
    try:
        check = check_problem(write(tmp_path, source, name="good.py"), limits=ProblemLimits(timeout_s=60))
        assert check.size.input_bytes == 4 * 8 * 4
        assert time.monotonic() - started < 60
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), 9)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and waiting for its reaper, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------------------------ reusing a check


def test_a_second_init_of_the_same_file_runs_none_of_its_code(tmp_path):
    """The file counts its own runs: init runs it once (in the child, never in its own process); a second init in a
    fresh process reuses that check and runs it not at all; once edited, it is checked again."""
    runs = tmp_path / "runs.txt"
    problem = write(tmp_path, counting_runs(runs), name="good.py")

    first, _, first_workspace = run_init(problem, tmp_path / "ws1")
    assert first.returncode == 0, first.stderr
    assert runs.read_text() == "ran\n"

    second, _, second_workspace = run_init(problem, tmp_path / "ws2")
    assert second.returncode == 0, second.stderr
    assert runs.read_text() == "ran\n"
    assert (second_workspace / "model_new.py").read_text() == (first_workspace / "model_new.py").read_text()
    assert (second_workspace / "model.py").read_text() == problem.read_text()

    problem.write_text(problem.read_text() + "\n# edited\n")
    third, _, _ = run_init(problem, tmp_path / "ws3")
    assert third.returncode == 0, third.stderr
    assert runs.read_text() == "ran\nran\n"


def test_a_check_is_kept_in_the_process_and_made_again_for_another_device(tmp_path, cache_dir):
    runs = tmp_path / "runs.txt"
    problem = write(tmp_path, counting_runs(runs), name="good.py")
    limits = ProblemLimits(timeout_s=60, memory_bytes=2**30)

    first = check_problem(problem, limits=limits)
    shutil.rmtree(cache_dir)  # what is left is this process's memory of the check
    again = check_problem(problem, limits=limits)
    assert runs.read_text() == "ran\n"
    assert again == first and again.problem_id == problem_id_of(problem.read_text())

    check_problem(problem, limits=limits, device="cpu")
    assert runs.read_text() == "ran\n" * 2


def test_a_failed_check_is_made_again(tmp_path):
    runs = tmp_path / "runs.txt"
    problem = write(tmp_path, counting_runs(runs) + "\nsys.exit(3)\n")
    limits = ProblemLimits(timeout_s=60, memory_bytes=2**30)
    for attempt in (1, 2):
        with pytest.raises(ProblemError, match="exited with code 3"):
            check_problem(problem, limits=limits)
        assert runs.read_text() == "ran\n" * attempt


# ------------------------------------------------------------------------------------ the estimate


def meta_size(path: Path) -> ProblemSize:
    problem = load_problem(path, validate=False)
    return measure(*validated_on_meta(problem))


def test_the_estimate_refuses_four_tib_in_well_under_a_second(tmp_path):
    meta_size(EXAMPLES / "layernorm.py")  # torch's meta kernels are imported once per process; not timed
    path = write(tmp_path, FOUR_TIB, name="huge.py")
    started = time.monotonic()
    size = meta_size(path)
    with pytest.raises(ProblemError) as caught:
        require_fits(size, path.name, device=None, gpu_memory_bytes=None)
    assert time.monotonic() - started < 1.0
    assert size.input_bytes == 4 * 2**40 and size.output_bytes == 4 * 2**40
    message = str(caught.value)
    assert "huge.py needs 24.0 TiB of GPU memory" in message
    assert "4.0 TiB of inputs" in message and "more than any GPU has" in message
    assert caught.value.hint


def test_an_example_is_measured_and_fits(tmp_path):
    size = meta_size(EXAMPLES / "layernorm.py")
    assert size.input_bytes > 0 and size.output_bytes == size.input_bytes  # layernorm keeps the shape
    assert size.parameter_bytes > 0  # its weight and bias
    require_fits(size, "layernorm.py", device=None, gpu_memory_bytes=None)
    require_fits(size, "layernorm.py", device="cuda", gpu_memory_bytes=80 * 2**30, gpu_name="H100")
    require_fits(size, "layernorm.py", device="cpu", gpu_memory_bytes=None)


def test_a_gpu_too_small_is_named_with_its_memory():
    size = ProblemSize(input_bytes=2**30, output_bytes=2**30, parameter_bytes=0)
    with pytest.raises(ProblemError, match=r"6\.0 GiB of GPU memory .* more than the 4\.0 GiB of the Tiny GPU"):
        require_fits(size, "p.py", device="cuda:0", gpu_memory_bytes=4 * 2**30, gpu_name="Tiny GPU")
    require_fits(size, "p.py", device="cuda:0", gpu_memory_bytes=6 * 2**30, gpu_name="Tiny GPU")  # exactly fits


def test_unknown_outputs_are_counted_as_at_least():
    size = ProblemSize(input_bytes=LARGEST_GPU_BYTES, output_bytes=None, parameter_bytes=0)
    with pytest.raises(ProblemError, match="needs at least .* outputs not known"):
        require_fits(size, "p.py", device=None, gpu_memory_bytes=None)


def test_judging_on_the_cpu_checks_the_host(tmp_path):
    size = ProblemSize(input_bytes=2**50, output_bytes=0, parameter_bytes=0)
    with pytest.raises(ProblemError, match="on the host to be judged on the CPU"):
        require_fits(size, "p.py", device="cpu", gpu_memory_bytes=None)


def test_parameters_count_twice():
    size = ProblemSize(input_bytes=0, output_bytes=0, parameter_bytes=10)
    assert size.device_bytes == 20


# -------------------------------------------------------------------------------- the host budget


def test_the_host_budget_refuses_before_allocating():
    with HostBudget(2**20) as budget:
        small = torch.randn(1000)
        assert budget.live_bytes == 4000
        with pytest.raises(HostBudgetExceeded) as caught:
            torch.empty(2**40, dtype=torch.uint8)  # would need 1 TiB
        assert caught.value.needed_bytes == 2**40 + 4000
        del small
        assert budget.live_bytes == 0
        torch.empty(2**19, dtype=torch.uint8)  # views and data-dependent calls still work
        assert torch.arange(4)[1:].sum().item() == 6


def test_the_fallback_in_process_refuses_with_the_numbers(tmp_path):
    source = with_body("get_inputs", "n = int(torch.tensor(4).item())").replace(
        "return [torch.randn(4, 8)]", "return [torch.randn(n * 2**30)]"
    )
    with pytest.raises(ProblemError, match=r"get_inputs\(\) in .*bad\.py cannot run on meta tensors .* 16\.0 GiB"):
        load_problem(write(tmp_path, source), host_memory_bytes=2**30)


def test_the_fallback_still_loads_a_small_problem(tmp_path):
    source = with_body("get_inputs", "n = int(torch.tensor(4).item())").replace("randn(4, 8)", "randn(n, 8)")
    model, inputs = validated_on_meta(load_problem(write(tmp_path, source), validate=False), host_memory_bytes=2**30)
    assert inputs[0].shape == (4, 8) and inputs[0].device.type == "cpu"


# ------------------------------------------------------------------------------------- the API


def test_check_problem_returns_the_size(tmp_path):
    check = check_problem(EXAMPLES / "layernorm.py", limits=ProblemLimits(timeout_s=60, memory_bytes=2**30))
    assert check.size == meta_size(EXAMPLES / "layernorm.py")


def test_limits_from_the_environment():
    limits = ProblemLimits.from_env({"KERNELPILOT_PROBLEM_TIMEOUT": "2.5", "KERNELPILOT_PROBLEM_MEMORY": "512MiB"})
    assert limits == ProblemLimits(timeout_s=2.5, memory_bytes=512 * 2**20)
    assert ProblemLimits.from_env({}).timeout_s == 120
    assert 0 < ProblemLimits.from_env({}).memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert parse_bytes("4G", "X") == 4 * 10**9 and parse_bytes("1000", "X") == 1000
    with pytest.raises(ProblemError, match="KERNELPILOT_PROBLEM_MEMORY='lots' is not a number of bytes"):
        ProblemLimits.from_env({"KERNELPILOT_PROBLEM_MEMORY": "lots"})
    with pytest.raises(ProblemError, match="not a positive number of seconds"):
        ProblemLimits.from_env({"KERNELPILOT_PROBLEM_TIMEOUT": "0"})


def test_a_refused_problem_leaves_no_judge_worker_behind(tmp_path):
    """optimize starts the judge's worker while it checks the problem (`checked_run`); a problem the check refuses
    ends the run with the check's sentence and nothing of the worker left running."""
    from kernelpilot.config import Settings
    from kernelpilot.harness.orphans import children
    from kernelpilot.optimize import checked_run

    before = children()
    with pytest.raises(ProblemError, match="exited with code 0"):
        with checked_run(write(tmp_path, "import os\nos._exit(0)\n" + VALID), Settings(device="cpu")):
            pass
    assert children() - before == set()
