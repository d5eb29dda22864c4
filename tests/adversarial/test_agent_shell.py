"""The agent's Bash tool against a model that writes where it must not: the static write guard reads the command
line, but a program run from it (python, a compiled binary) can write anywhere the user can. In training, many
trajectories share one machine, the judge's caches (signed baselines, the precompiled torch header) and
kernelpilot's own files: a model that writes there changes what the judge runs for every trajectory after it. Where
the system has Landlock, a Bash command's processes may write only inside the workspace (and /dev)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernelpilot.agent import ToolContext
from kernelpilot.agent.tools import default_tools
from kernelpilot.harness.confine import landlock_available
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace
from kp_testing import run_cache_dir, scale_mul_binding, scale_mul_candidate, scale_problem, write_problem

BASH = next(tool for tool in default_tools() if tool.name == "Bash")

pytestmark = pytest.mark.skipif(not landlock_available(), reason="this kernel has no Landlock to confine Bash with")


def _context(folder: Path) -> ToolContext:
    ws, _ = init_workspace(write_problem(folder, scale_problem(rows=8, features=16)), folder / "ws")
    return ToolContext(workspace=ws, judge=None)


# Each writes outside its workspace through a program, which the command-line guard cannot see.
ESCAPES = {
    "python_writes_a_sibling_workspace": "python3 -c \"open('{target}', 'w').write('poisoned')\"",
    "python_appends_to_a_cache_file": "python3 -c \"open('{target}', 'a').write('forged')\"",
    "a_script_file_it_wrote_first": "printf 'open(\"{target}\", \"w\").write(\"x\")' > w.py && python3 w.py",
    "perl_writes": "perl -e 'open(F, \">{target}\") or die \"$!\"; print F \"x\"; close(F)'",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_program_run_by_bash_cannot_write_outside_its_workspace(tmp_path, name):
    ctx = _context(tmp_path / "mine")
    elsewhere = tmp_path / "elsewhere"  # another trajectory's workspace, the judge's cache folder, ...
    elsewhere.mkdir()
    target = elsewhere / "kernel.cu"
    if name == "python_appends_to_a_cache_file":
        target.write_text("signed entry\n")
    output = BASH.run({"command": ESCAPES[name].format(target=target), "timeout_s": 60}, ctx)

    assert output.data["exit_code"] != 0, output.text
    assert not target.exists() or target.read_text() == "signed entry\n", f"{name} wrote {target}"
    assert "Permission denied" in output.text or "PermissionError" in output.text, output.text


def test_bash_still_writes_builds_and_runs_inside_its_workspace(tmp_path):
    ctx = _context(tmp_path / "mine")
    command = (
        "python3 -c \"open('notes.txt', 'w').write('ok')\" && echo scratch > \"$TMPDIR/t\" && cat \"$TMPDIR/t\" "
        "&& python3 -c 'import torch; print(torch.ones(2).sum().item())' && echo x > /dev/null"
    )
    output = BASH.run({"command": command, "timeout_s": 120}, ctx)
    assert output.data["exit_code"] == 0, output.text
    assert (ctx.workspace.root / "notes.txt").read_text() == "ok"
    assert output.text.splitlines()[:2] == ["scratch", "2.0"], output.text


def test_the_judges_process_is_not_confined_by_a_bash_command(tmp_path):
    ctx = _context(tmp_path / "mine")
    BASH.run({"command": "true", "timeout_s": 30}, ctx)
    outside = tmp_path / "the-judge-writes-here.txt"
    outside.write_text("still writable")  # the confinement is the command's alone
    assert outside.read_text() == "still writable" and os.getpid() > 0


# ---------------------------------------------------------------------------------- what outlives a command

# Each leaves a process behind that writes its pid to leftover.pid before the command returns, then waits: such a
# process could change the workspace while the judge builds or verifies it, or between the tamper check and the
# reference's load, long after the Bash call that started it was over. Its output goes nowhere, so it does not keep
# the call waiting.
LEFTOVERS = {
    "a_background_job": "(sh -c 'echo $$ > leftover.pid; exec sleep 300') > /dev/null 2>&1 &",
    "a_setsid_daemon": "setsid sh -c 'echo $$ > leftover.pid; exec sleep 300' > /dev/null 2>&1 < /dev/null &",
    "a_python_double_fork": (
        "python3 -c \"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        open('leftover.pid', 'w').write(str(os.getpid())); time.sleep(300)\n    os._exit(0)\n\" "
        "> /dev/null 2>&1"
    ),
}


def _alive(pid: int) -> bool:
    """Whether `pid` is a process that still runs (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _assert_ended(pid: int, failure: str) -> None:
    """`pid` has ended; if not, fail with `failure` (and kill it, so no test leaves it behind)."""
    try:
        assert not _alive(pid), f"{failure} (pid {pid})"
    finally:
        if _alive(pid):
            os.kill(pid, 9)


@pytest.mark.parametrize("name", sorted(LEFTOVERS))
def test_no_process_a_bash_command_starts_outlives_the_call(tmp_path, name):
    ctx = _context(tmp_path / "mine")
    pid_file = ctx.workspace.root / "leftover.pid"
    # The command waits until its leftover has written its pid, so the pid is known before the call returns.
    command = f"{LEFTOVERS[name]}\nwhile [ ! -s leftover.pid ]; do sleep 0.05; done"
    output = BASH.run({"command": command, "timeout_s": 60}, ctx)

    assert output.data["exit_code"] == 0 and not output.data["timed_out"], output.text
    _assert_ended(int(pid_file.read_text()), f"{name} left a process running after the Bash call returned")


def test_a_daemon_left_by_a_command_that_times_out_is_killed_with_it(tmp_path):
    ctx = _context(tmp_path / "mine")
    command = f"{LEFTOVERS['a_setsid_daemon']}\nwhile [ ! -s leftover.pid ]; do sleep 0.05; done\nsleep 300"
    output = BASH.run({"command": command, "timeout_s": 3}, ctx)

    assert output.data["timed_out"], output.text
    _assert_ended(int((ctx.workspace.root / "leftover.pid").read_text()), "the daemon outlived the command's timeout")


def test_orphans_that_end_during_a_command_are_reaped_as_they_end(tmp_path):
    """The wrapper is the subreaper of all a command starts: an orphan that ends while the command still runs is
    reaped then, not left a zombie until the command ends."""
    ctx = _context(tmp_path / "mine")
    count_zombies = ("python3 -c \"import glob, sys; print(sum(1 for stat in glob.glob('/proc/[0-9]*/stat') "
                     "if open(stat).read().rsplit(')', 1)[1].split()[:2] == ['Z', sys.argv[1]]))\" $PPID")  # fmt: skip
    command = f"for i in $(seq 20); do (sleep 0.01 &); done; sleep 1; {count_zombies}"
    output = BASH.run({"command": command, "timeout_s": 60}, ctx)
    assert output.data["exit_code"] == 0, output.text
    assert output.text.strip().splitlines()[-1] == "0", output.text


def test_a_background_job_that_holds_the_output_does_not_hold_the_call(tmp_path):
    ctx = _context(tmp_path / "mine")
    output = BASH.run({"command": "sleep 300 & echo started", "timeout_s": 20}, ctx)
    assert output.data["exit_code"] == 0 and not output.data["timed_out"], output.text
    assert output.text.strip().startswith("started"), output.text


# ------------------------------------------------------------------------------ the reference and its record

# A program run by Bash may write anywhere in its workspace, .kernelpilot/ included (the command-line guard that
# refuses the name is a rail for honest slips: a script builds the name). This one makes the reference agree with a
# wrong kernel (it adds 1 as the kernel does), and writes the manifest the tamper check compares against and the
# pristine copy Bash restores protected files from to match.
REWRITE_THE_REFERENCE = """cat > w.py <<'END'
import hashlib, json, os
record = '.kernel' + 'pilot/manifest.json'
source = open('model.py').read().replace('return x * self.scale', 'return x * self.scale + 1.0')
for path in ('model.py', '.kernel' + 'pilot/pristine/model.py'):
    if os.path.exists(path):
        os.chmod(path, 0o644)
    open(path, 'w').write(source)
manifest = json.load(open(record))
manifest['files']['model.py'] = hashlib.sha256(source.encode()).hexdigest()
manifest['problem_id'] = hashlib.sha256(source.encode()).hexdigest()[:16]
json.dump(manifest, open(record, 'w'), indent=2)
END
python3 w.py && rm w.py"""


@pytest.mark.cuda_build
def test_a_reference_rewritten_with_its_manifest_is_not_what_the_judge_verifies_against(tmp_path):
    from kernelpilot.harness.judge import Judge

    ctx = _context(tmp_path / "mine")
    root = ctx.workspace.root
    for example in EXAMPLE_KERNELS:
        (root / example).unlink()
    (root / "kernels" / "scale_mul_binding.cpp").write_text(scale_mul_binding(offset=1.0))  # wrong by 1
    (root / "model_new.py").write_text(scale_mul_candidate(features=16))

    output = BASH.run({"command": REWRITE_THE_REFERENCE, "timeout_s": 60}, ctx)
    assert output.data["exit_code"] == 0, output.text
    assert "+ 1.0" in (root / "model.py").read_text(), "the cheat did not rewrite the reference"

    with Judge("cpu", arch="9.0", cache_dir=run_cache_dir(tmp_path)) as judge:
        result = judge.evaluate(root, trials=2, bench=False)

    assert (result.error_kind, result.reward) == ("tampered", -1), result.message
    assert "model.py" in result.message
