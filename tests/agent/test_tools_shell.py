"""Bash on real scaffolded workspaces: its typed result and how the model reads it, and its guard rails (escapes
refused before anything runs, protected files restored, timeouts that kill the whole process group, long output
capped in the middle)."""

from __future__ import annotations

import dataclasses
import shutil
import stat
import time

import pytest
from tools_testing import call

from kernelpilot.agent import RecoverableError
from kernelpilot.agent.observations import command_text
from kernelpilot.agent.session import tool_result
from kernelpilot.agent.shell_guard import WriteGuard
from kernelpilot.agent.tool_results import CommandRun
from kernelpilot.agent.tools.shell import BASH_OUTPUT_LIMIT, PRISTINE_DIR
from kernelpilot.workspace import PROTECTED_REASON, tampered_files


# -------------------------------------------------------------------------------------------------- Bash


def test_bash_runs_in_the_workspace_with_home_and_tmpdir_inside_and_no_stdin(ctx):
    root = ctx.workspace.root
    output = call(ctx, "Bash", command='pwd; echo "$HOME"; echo "$TMPDIR"; cat; echo done', timeout_s=20)
    lines = output.text.splitlines()
    assert lines[0] == str(root)
    assert lines[1] == lines[2] == str(root / ".kernelpilot" / "tmp")
    assert lines[3] == "done", "cat reads an empty stdin and returns at once"
    assert output.data["exit_code"] == 0 and not output.data["timed_out"]


def test_bash_reports_a_failing_exit_code(ctx):
    output = call(ctx, "Bash", command="echo oops >&2; exit 3")
    assert output.text == "oops\n[exit code 3]"
    assert output.data["exit_code"] == 3


@pytest.mark.parametrize(
    "command",
    ["echo x > /tmp/x", "cd / && touch a", "cp model_new.py ../", "rm -rf .."],
)
def test_bash_refuses_escapes_before_running_them(ctx, command):
    parent = ctx.workspace.root.parent
    with pytest.raises(RecoverableError, match="Refused before running: .* outside the workspace"):
        call(ctx, "Bash", command=command)
    assert not (parent / "model_new.py").exists()
    assert ctx.workspace.model_new_path.is_file() and (parent / "problem.py").is_file()


def test_a_refused_command_runs_none_of_its_parts(ctx, tmp_path):
    marker = ctx.workspace.root / "notes.txt"
    with pytest.raises(RecoverableError, match=str(tmp_path / "outside.txt")):
        call(ctx, "Bash", command=f"echo inside > notes.txt; echo x > {tmp_path}/outside.txt")
    assert not marker.exists() and not (tmp_path / "outside.txt").exists()


REFUSED = [
    "bash -c 'echo x > /tmp/x'",
    "sh -ec 'touch /etc/kp'",
    "echo a#b > /tmp/x",  # `#` inside a word starts no comment
    "cat <<<hello > /tmp/x",
    "sed -i 's/a/b/' /tmp/f",
    "tee /tmp/log < model.py",
    "dd if=model.py of=/tmp/copy",
    "cp a /tmp/x 2>/dev/null",
    "mv model_new.py /tmp/",
    "mv ../problem.py .",  # moving a file in removes it from outside
    "ln -s model.py /tmp/link",
    "env A=1 timeout 5 rm /tmp/q",
    "mkdir -p {notes,/tmp/kp}",
    "rm -rf ../*",
    "find / -name x -delete",
    r"find . -exec cp {} /tmp \;",
    "echo $(rm /tmp/x)",
    "(cd kernels); rm ../x",  # the subshell's cd does not last: ../x may be outside
    "cd kernels\nrm ../../x",
    "rm ~root/x",
    'rm "$SOME_DIR/x"',
    "ls | xargs rm",
    "rm -rf ../ws",  # the workspace itself
    "rm -rf .kernelpilot",
    "echo x > .kernelpilot/manifest.json",
]

ALLOWED = [
    "echo hi > notes.txt 2>&1",
    "cd kernels && cat ../model_new.py > /dev/null",
    "sed -i '/pattern/d' notes/a.md",
    "sed -n '1,5p' /usr/include/stdio.h",
    "cp /usr/include/stdio.h kernels/",
    "cat > notes/a.md <<'EOF'\ndon't > /tmp/x\nEOF\necho done",
    "echo \"a > /tmp/b\" # a comment > /tmp/c",
    "echo x > $HOME/a; echo y > ~/b; echo z > ${TMPDIR}/c",
    "find . -name '*.o' -delete",
    "mv kernels/a.cu .",
    "for f in kernels/*.cu; do cp $f notes/; done",
    "python -c 'print(1)' > out.txt",
    "cd; ls",
]


@pytest.mark.parametrize("command", REFUSED)
def test_write_guard_refuses(tmp_path, command):
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    with pytest.raises(RecoverableError, match="Refused before running"):
        WriteGuard(root, root / ".kernelpilot" / "tmp").check(command)


@pytest.mark.parametrize("command", ALLOWED)
def test_write_guard_allows(tmp_path, command):
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    WriteGuard(root, root / ".kernelpilot" / "tmp").check(command)


def test_heredoc_bodies_are_written_not_checked_as_commands(ctx):
    command = "mkdir -p notes && cat > notes/plan.md <<'EOF'\nWe don't write > /tmp/x here.\nEOF\ncat notes/plan.md"
    output = call(ctx, "Bash", command=command)
    assert output.text == "We don't write > /tmp/x here."


def test_an_unparsable_command_says_so(ctx):
    with pytest.raises(RecoverableError, match="could not parse the command .*No closing quotation"):
        call(ctx, "Bash", command="echo 'unclosed")


def test_bash_restores_a_protected_file_a_command_changed(ctx):
    ws = ctx.workspace
    original = ws.model_path.read_text()
    output = call(ctx, "Bash", command="chmod +w model.py; echo >> model.py; rm kernels/kp_cuda.h")
    assert "restored model.py, kernels/kp_cuda.h: protected" in output.text
    assert output.data["restored"] == ["model.py", "kernels/kp_cuda.h"]
    assert tampered_files(ws) == []
    assert ws.model_path.read_text() == original
    assert stat.S_IMODE(ws.model_path.stat().st_mode) == 0o444, "the reference is read-only again"
    assert (ws.root / PRISTINE_DIR / "model.py").read_text() == original


def test_bash_says_when_a_protected_file_cannot_be_restored(ctx):
    ws = ctx.workspace
    call(ctx, "Bash", command="true")  # the pristine copies are made
    shutil.rmtree(ws.root / PRISTINE_DIR)
    (ws.root / "setup.py").write_text("# changed before the tool ever saw the original\n")
    output = call(ctx, "Bash", command="ls")
    assert output.data["not_restored"] == ["setup.py"]
    assert "not restorable: setup.py" in output.text


def test_bash_kills_a_command_and_its_children_at_the_timeout(ctx):
    root = ctx.workspace.root
    started = time.monotonic()
    output = call(ctx, "Bash", command="(sleep 2; echo late > late.txt) & echo started; sleep 60", timeout_s=1)
    assert time.monotonic() - started < 10
    assert output.data["timed_out"]
    assert output.text.startswith("started\n[timed out after 1 s")
    time.sleep(2.5)
    assert not (root / "late.txt").exists(), "the background child was killed with the command"


def test_bash_keeps_the_head_and_tail_of_long_output(ctx):
    output = call(ctx, "Bash", command="seq 1 200000")
    lines = output.text.splitlines()
    assert len(output.text) < BASH_OUTPUT_LIMIT + 200
    assert lines[0] == "1" and lines[-1] == "200000"
    assert "characters" in output.text and "cut from the middle of the output" in output.text
    assert output.data["cut_chars"] > 1_000_000


# ---------------------------------------------------------------------------------------------- typed result


def test_bash_returns_a_typed_run_that_the_model_reads_as_one_text(ctx):
    output = call(ctx, "Bash", command="chmod +w model.py; echo >> model.py; echo hi; exit 4", timeout_s=30)
    run = output.result
    assert isinstance(run, CommandRun)
    assert (run.exit_code, run.timed_out, run.timeout_s, run.output) == (4, False, 30, "hi\n")
    assert run.restored == ["model.py"] and run.not_restored == [] and run.cut_chars == 0
    assert output.text == command_text(run) == (
        f"hi\n[exit code 4]\n[kernelpilot restored model.py: protected, {PROTECTED_REASON}; put your work in kernels/ "
        "and model_new.py]"
    )
    # The transcript keeps the numbers, not the output again (the tool message beside them holds it).
    assert "output" not in output.data and output.data["exit_code"] == 4
    record = {"type": "tool", "name": "Bash", "result_type": "CommandRun", "data": output.data}
    assert tool_result(record) == dataclasses.replace(run, output="")


def test_a_timed_out_command_and_an_unrestorable_file_are_told_so():
    killed = CommandRun("sleep 60", exit_code=None, timed_out=True, timeout_s=5)
    assert command_text(killed) == "(no output)\n[timed out after 5 s: the command and its child processes were killed]"
    lost = CommandRun("rm setup.py", exit_code=0, not_restored=["setup.py"])
    assert command_text(lost).splitlines()[1].startswith("[protected files changed and not restorable: setup.py;")
