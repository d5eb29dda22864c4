"""The agent's tools on real scaffolded workspaces: argument schemas, Bash's guard rails (escapes refused, protected
files restored, timeouts, output cap), Glob, Read, Write, MultiEdit, TodoWrite, Finish, the harness tools through a
real CPU judge (one shared build), ncu's report parsing, and on a GPU the whole chain with the example kernel."""

from __future__ import annotations

import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from kernelpilot.agent import RecoverableError, Tool, ToolContext
from kernelpilot.agent.observations import build_text, eval_text, ncu_text
from kernelpilot.agent.shell_guard import WriteGuard
from kernelpilot.agent.tools import default_tools, find_tool, tool_schemas
from kernelpilot.agent.tools.files import GLOB_LIMIT
from kernelpilot.agent.tools.ncu import NCU_DRIVER, NCU_TIMEOUT_S, driver_environment, parse_ncu_csv
from kernelpilot.agent.tools.shell import BASH_OUTPUT_LIMIT, PRISTINE_DIR, ProcessRun, run_process
from kernelpilot.config import Settings
from kernelpilot.results import (
    BenchResult,
    BuildResult,
    Diagnostic,
    EvalResult,
    KernelResources,
    KernelTime,
    Roofline,
    Timing,
    TrialResult,
    VerifyResult,
)
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace, tampered_files
from kp_testing import EXAMPLE_KERNEL_CANDIDATE, scale_problem, scale_shift_problem, write_problem

PROBLEM = scale_problem(rows=8, features=16)
TOOLS = {tool.name: tool for tool in default_tools()}


def make_workspace(folder: Path, source: str = PROBLEM) -> ToolContext:
    ws, _ = init_workspace(write_problem(folder, source), folder / "ws")
    return ToolContext(workspace=ws, judge=None)


@pytest.fixture
def ctx(tmp_path) -> ToolContext:
    return make_workspace(tmp_path)


def call(ctx: ToolContext, tool_name: str, **args):
    return TOOLS[tool_name].run(args, ctx)


# ------------------------------------------------------------------------------------- schemas, registry

SPEC = {  # tool -> (properties, required), as the agent's interface fixes them
    "Bash": ({"command", "timeout_s"}, {"command"}),
    "Glob": ({"pattern"}, {"pattern"}),
    "Read": ({"path", "offset", "limit"}, {"path"}),
    "Write": ({"path", "content"}, {"path", "content"}),
    "MultiEdit": ({"path", "edits"}, {"path", "edits"}),
    "TodoWrite": ({"todos"}, {"todos"}),
    "Compile": (set(), set()),
    "Verify": ({"trials"}, set()),
    "Profile": (set(), set()),
    "Ncu": ({"kernel"}, set()),
    "Finish": ({"summary"}, {"summary"}),
}


def test_default_tools_are_the_fixed_set_in_openai_function_format():
    tools = default_tools()
    assert all(isinstance(tool, Tool) for tool in tools)
    schemas = tool_schemas(tools)
    assert [schema["function"]["name"] for schema in schemas] == list(SPEC)
    for schema in schemas:
        assert schema["type"] == "function"
        function = schema["function"]
        properties, required = SPEC[function["name"]]
        assert set(function["parameters"]["properties"]) == properties
        assert set(function["parameters"]["required"]) == required
        assert function["parameters"]["additionalProperties"] is False
        assert len(function["description"]) > 80, "descriptions tell the model when to use the tool"


def test_multiedit_and_todowrite_item_schemas():
    edit_item = TOOLS["MultiEdit"].parameters["properties"]["edits"]["items"]
    assert set(edit_item["properties"]) == {"old_string", "new_string", "replace_all"}
    assert set(edit_item["required"]) == {"old_string", "new_string"}
    todo_item = TOOLS["TodoWrite"].parameters["properties"]["todos"]["items"]
    assert todo_item["properties"]["status"]["enum"] == ["pending", "in_progress", "completed"]


def test_find_tool_names_the_valid_tools_for_an_unknown_one():
    assert find_tool(default_tools(), "Read").name == "Read"
    with pytest.raises(RecoverableError, match="no tool named 'Edit'; the tools are: Bash, Glob, Read, Write, MultiEdit"):
        find_tool(default_tools(), "Edit")


@pytest.mark.parametrize(
    ("tool_name", "args", "message"),
    [
        ("Bash", {}, "Bash: the argument `command` is required"),
        ("Bash", {"command": "ls", "cmd": "ls"}, "Bash: unknown argument `cmd`; it takes: command, timeout_s"),
        ("Bash", {"command": ["ls"]}, "`command` must be a string, not array"),
        ("Bash", {"command": "ls", "timeout_s": "10"}, "`timeout_s` must be an integer, not string"),
        ("Bash", {"command": "ls", "timeout_s": True}, "`timeout_s` must be an integer, not boolean"),
        ("Bash", {"command": "ls", "timeout_s": 601}, "`timeout_s` must be at most 600, not 601"),
        ("Bash", {"command": ""}, "`command` must not be empty"),
        ("Read", {"path": "model.py", "offset": 0}, "`offset` must be at least 1, not 0"),
        ("MultiEdit", {"path": "model_new.py", "edits": []}, "`edits` needs at least 1 item"),
        ("MultiEdit", {"path": "model_new.py", "edits": [{"new_string": "x"}]}, "`edits[0].old_string` is required"),
        ("MultiEdit", {"path": "model_new.py", "edits": [{"old_string": "a", "new_string": "b", "replace_all": "yes"}]},
         "`edits[0].replace_all` must be a boolean"),
        ("TodoWrite", {"todos": [{"content": "x", "status": "done"}]},
         '`todos[0].status` must be one of "pending", "in_progress", "completed", not "done"'),
        ("Verify", {"trials": 100}, "`trials` must be at most 20"),
        ("Compile", {"clean": True}, "Compile: unknown argument `clean`; it takes: no arguments"),
        ("Finish", {}, "Finish: the argument `summary` is required"),
    ],
)  # fmt: skip
def test_bad_arguments_are_recoverable_errors_naming_the_problem(ctx, tool_name, args, message):
    with pytest.raises(RecoverableError) as caught:
        TOOLS[tool_name].run(args, ctx)
    assert message in str(caught.value)


def test_arguments_must_be_an_object(ctx):
    with pytest.raises(RecoverableError, match="Glob takes a JSON object of arguments, not array"):
        TOOLS["Glob"].run(["*.py"], ctx)


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


# ----------------------------------------------------------------------------------------- Glob and Read


def test_glob_lists_workspace_files_sorted_with_recursive_patterns(ctx):
    assert call(ctx, "Glob", pattern="kernels/*.cu").text == "kernels/example_scale_shift.cu"
    found = call(ctx, "Glob", pattern="**/*.py").data["matches"]
    assert found == sorted(found) and {"model.py", "model_new.py", "setup.py", "benchmark.py"} <= set(found)
    assert "kernels/" in call(ctx, "Glob", pattern="*").data["matches"]


def test_glob_hides_bookkeeping_and_never_leaves_the_workspace(ctx):
    call(ctx, "Bash", command="true")  # makes .kernelpilot/pristine/
    assert not any(name.startswith(".kernelpilot") for name in call(ctx, "Glob", pattern="**/*").data["matches"])
    for pattern in ("../*", "/etc/*", "kernels/../../*"):
        with pytest.raises(RecoverableError, match="leaves the workspace"):
            call(ctx, "Glob", pattern=pattern)
    assert call(ctx, "Glob", pattern="*.rs").text == "No file matches *.rs."
    assert "./" not in call(ctx, "Glob", pattern="**").data["matches"]
    with pytest.raises(RecoverableError, match="is not a glob pattern pathlib accepts"):
        call(ctx, "Glob", pattern=".")


def test_glob_caps_long_listings(ctx):
    notes = ctx.workspace.root / "notes"
    notes.mkdir()
    for index in range(GLOB_LIMIT + 50):
        (notes / f"n{index:03d}.md").write_text("")
    output = call(ctx, "Glob", pattern="notes/*.md")
    assert len(output.data["matches"]) == GLOB_LIMIT and output.data["total"] == GLOB_LIMIT + 50
    assert f"showing {GLOB_LIMIT} of {GLOB_LIMIT + 50} matches" in output.text


def test_read_numbers_lines_and_pages_with_offset_and_limit(ctx):
    path = ctx.workspace.root / "notes" / "lines.md"
    path.parent.mkdir()
    path.write_text("".join(f"line {n}\n" for n in range(1, 11)))
    output = call(ctx, "Read", path="notes/lines.md", offset=3, limit=2)
    assert output.text.splitlines() == ["     3\tline 3", "     4\tline 4", "(lines 3-4 of 10; continue with offset=5)"]
    assert call(ctx, "Read", path="notes/lines.md").text.splitlines()[-1] == "    10\tline 10"
    with pytest.raises(RecoverableError, match="has 10 lines, so offset 11 is past its end"):
        call(ctx, "Read", path="notes/lines.md", offset=11)


def test_read_refuses_missing_binary_folder_and_outside_paths(ctx):
    root = ctx.workspace.root
    (root / "kernels" / "blob.o").write_bytes(b"\x7fELF\x00\x01")
    with pytest.raises(RecoverableError, match="nothing.cu does not exist; find files with Glob"):
        call(ctx, "Read", path="kernels/nothing.cu")
    with pytest.raises(RecoverableError, match="blob.o is a binary file"):
        call(ctx, "Read", path="kernels/blob.o")
    with pytest.raises(RecoverableError, match="kernels is a folder"):
        call(ctx, "Read", path="kernels")
    with pytest.raises(RecoverableError, match="is outside the workspace"):
        call(ctx, "Read", path="../problem.py")
    with pytest.raises(RecoverableError, match="is outside the workspace"):
        call(ctx, "Read", path="/etc/hostname")


def test_read_shows_protected_files(ctx):
    assert "class Model(nn.Module):" in call(ctx, "Read", path="model.py").text


# --------------------------------------------------------------------------------------- Write, MultiEdit


def test_write_creates_and_overwrites_editable_files(ctx):
    root = ctx.workspace.root
    created = call(ctx, "Write", path="kernels/softmax.cu", content="// v1\n__global__ void k() {}\n")
    assert created.text == "Created kernels/softmax.cu (2 lines)." and created.data["created"]
    assert "+// v1" in created.data["diff"]
    again = call(ctx, "Write", path="kernels/softmax.cu", content="// v2\n")
    assert again.text.startswith("Overwrote") and "-// v1" in again.data["diff"]
    assert (root / "kernels" / "softmax.cu").read_text() == "// v2\n"
    call(ctx, "Write", path="notes/plan.md", content="# plan\n")
    assert (root / "notes" / "plan.md").read_text() == "# plan\n"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("model.py", "model.py is protected"),
        ("kernels/kp_registry.h", "kernels/kp_registry.h is protected"),
        ("kernels/../setup.py", "setup.py is protected"),
        ("run.sh", "run.sh is not a file the agent may write: only kernels/*.cu"),
        ("kernels/sub/deep.cu", "not a file the agent may write"),
        ("../escape.cu", "is outside the workspace"),
        ("/tmp/kp-escape.cu", "is outside the workspace"),
    ],
)
def test_write_refuses_protected_outside_and_other_files(ctx, path, message):
    with pytest.raises(RecoverableError, match=message.replace("*", r"\*")):
        call(ctx, "Write", path=path, content="x")
    assert not Path("/tmp/kp-escape.cu").exists()


SOURCE = "int a = 1;\nint b = 2;\nint c = 1;\n"


@pytest.fixture
def source(ctx) -> Path:
    path = ctx.workspace.root / "kernels" / "edit_me.cu"
    path.write_text(SOURCE)
    return path


def test_multiedit_applies_edits_in_order_and_returns_a_diff(ctx, source):
    edits = [{"old_string": "int b = 2;", "new_string": "int b = 20;"}, {"old_string": "b = 20", "new_string": "b = 21"}]
    output = call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=edits)
    assert source.read_text() == "int a = 1;\nint b = 21;\nint c = 1;\n"
    assert output.text == "Applied 2 edit(s) to kernels/edit_me.cu (+1 -1 lines)."
    assert "-int b = 2;\n+int b = 21;\n" in output.data["diff"]


def test_multiedit_is_all_or_nothing(ctx, source):
    edits = [{"old_string": "int a = 1;", "new_string": "int a = 5;"}, {"old_string": "int d = 4;", "new_string": "x"}]
    with pytest.raises(RecoverableError, match="Edit 2 of 2 on kernels/edit_me.cu: old_string was not found"):
        call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=edits)
    assert source.read_text() == SOURCE


def test_multiedit_shows_the_closest_line_when_the_text_is_missing(ctx, source):
    with pytest.raises(RecoverableError, match=r"closest line is 2: 'int b = 2;'"):
        call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=[{"old_string": "int b =  2;", "new_string": "x"}])


def test_multiedit_refuses_ambiguous_text_unless_replace_all(ctx, source):
    edit = {"old_string": " = 1;", "new_string": " = 7;"}
    with pytest.raises(RecoverableError, match=r"occurs 2 times \(lines 1, 3\); include more surrounding text"):
        call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=[edit])
    call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=[edit | {"replace_all": True}])
    assert source.read_text() == "int a = 7;\nint b = 2;\nint c = 7;\n"


def test_multiedit_refuses_no_op_empty_protected_and_missing_files(ctx, source):
    with pytest.raises(RecoverableError, match="are the same, so the edit changes nothing"):
        call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=[{"old_string": "a", "new_string": "a"}])
    with pytest.raises(RecoverableError, match="old_string is empty; to write a whole file use Write"):
        call(ctx, "MultiEdit", path="kernels/edit_me.cu", edits=[{"old_string": "", "new_string": "a"}])
    with pytest.raises(RecoverableError, match="model.py is protected"):
        call(ctx, "MultiEdit", path="model.py", edits=[{"old_string": "Model", "new_string": "M"}])
    with pytest.raises(RecoverableError, match="new.cu does not exist; create it with Write"):
        call(ctx, "MultiEdit", path="kernels/new.cu", edits=[{"old_string": "a", "new_string": "b"}])


# --------------------------------------------------------------------------------------- TodoWrite, Finish


def test_todowrite_replaces_the_plan_and_renders_it(ctx):
    ctx.todos = [{"content": "old", "status": "pending"}]
    todos = [
        {"content": "read model.py", "status": "completed"},
        {"content": "write the kernel", "status": "in_progress"},
        {"content": "profile", "status": "pending"},
    ]
    output = call(ctx, "TodoWrite", todos=todos)
    assert ctx.todos == todos
    assert output.text.splitlines() == [
        "Todo list (1/3 done):",
        "  [x] read model.py",
        "  [>] write the kernel",
        "  [ ] profile",
    ]


def test_todowrite_allows_one_item_in_progress(ctx):
    todos = [{"content": "a", "status": "in_progress"}, {"content": "b", "status": "in_progress"}]
    with pytest.raises(RecoverableError, match="2 items are in_progress"):
        call(ctx, "TodoWrite", todos=todos)
    assert ctx.todos == []


def test_finish_ends_the_run_with_the_summary(ctx):
    output = call(ctx, "Finish", summary="fused softmax, 1.3x vs compile")
    assert output.finished and output.data == {"summary": "fused softmax, 1.3x vs compile"}


# ---------------------------------------------------------------------------------------- harness tools


@pytest.mark.parametrize("tool_name", ["Compile", "Verify", "Profile"])
def test_harness_tools_need_a_judge(ctx, tool_name):
    with pytest.raises(RecoverableError, match=f"{tool_name} needs the judge"):
        call(ctx, tool_name)


def test_ncu_without_ncu_or_a_gpu_answers_in_one_sentence(ctx):
    output = call(ctx, "Ncu")
    assert not output.data["available"]
    assert output.text.count(". ") == 0 and output.text.endswith("kernel breakdown.")


NCU_CSV = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","91.52"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,234,567"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","32"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","20.1"
"1","4242","python","h","tiny_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","0.5"
"1","4242","python","h","tiny_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","1.5"
"1","4242","python","h","tiny_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","3.1"
==PROF== Disconnected from process 4242
'''


def test_ncu_csv_becomes_one_summary_line_per_launch():
    launches = parse_ncu_csv(NCU_CSV)
    assert [launch["kernel"] for launch in launches] == ["softmax_kernel", "tiny_kernel"]
    assert launches[0]["duration_us"] == pytest.approx(1234.567)
    assert launches[0]["registers"] == 32 and launches[1]["occupancy_pct"] == pytest.approx(3.1)
    text = ncu_text(ProcessRun(output="", returncode=0, timed_out=False, seconds=1.0), launches, None, NCU_TIMEOUT_S)
    lines = text.splitlines()
    assert lines[0] == "ncu: 2 kernel launch(es) in one forward call:"
    assert lines[1] == "  softmax_kernel: 1235 us, DRAM 91.5%, SM 20.1%, 32 regs -> memory-bound (DRAM busy): move fewer bytes"
    assert "occupancy 3.1%" in lines[2] and "latency-bound" in lines[2]


def test_ncu_with_no_profiled_launch_shows_why():
    failed = ProcessRun(output="==ERROR== ERR_NVGPUCTRPERM - no permission\n", returncode=1, timed_out=False, seconds=1.0)
    assert ncu_text(failed, [], None, NCU_TIMEOUT_S) == "ncu profiled no kernel (exit code 1).\n==ERROR== ERR_NVGPUCTRPERM - no permission"
    unmatched = ProcessRun(output="", returncode=0, timed_out=False, seconds=1.0)
    assert ncu_text(unmatched, [], "gemm", NCU_TIMEOUT_S) == "ncu profiled no kernel (no kernel matched 'gemm')."


def test_build_text_lists_errors_at_most_twenty_and_kernel_resources():
    errors = [Diagnostic("error", f"problem {n}", "kernels/a.cu", n, 3) for n in range(1, 26)]
    failed = BuildResult(ok=False, workspace="/w", extension_name="kp_kernels", arch="9.0", compiled=["kernels/a.cu"],
                         diagnostics=[Diagnostic("error", "build stopped", tool="ninja"), *errors], error="25 errors")  # fmt: skip
    lines = build_text(failed).splitlines()
    assert lines[:4] == ["Build FAILED: 25 errors", "Recompiled: kernels/a.cu.", "Errors (25):", "  kernels/a.cu:1:3: problem 1"]
    assert lines[-1] == "  (5 more errors not shown; fix these first)" and "build stopped" not in lines
    kernel = KernelResources(kernel="void k<4>(float*)", arch="sm_90", registers=40, shared_bytes=4096, spill_stores=8)
    built = BuildResult(ok=True, workspace="/w", extension_name="kp_kernels", arch="9.0", resources=[kernel], seconds=1.5)
    assert build_text(built).splitlines() == [
        "Build ok for sm_90 in 1.5 s; recompiled: nothing (up to date).",
        "Kernels (ptxas): registers, shared memory, stack, spill stores/loads",
        "  void k<4>(float*): 40 regs, 4096 B smem, 0 B stack, spills 8/0 (SPILLING)",
    ]


def test_eval_text_shows_times_speedups_speed_of_light_and_top_kernels():
    def timing(ms: float) -> Timing:
        return Timing(median_ms=ms, p10_ms=ms * 0.98, p90_ms=ms * 1.02, mean_ms=ms, runs=50)

    bench = BenchResult(
        ok=True, gpu="NVIDIA H100 80GB HBM3", candidate=timing(1.0), eager=timing(2.0), compiled=timing(1.5),
        speedup_vs_eager=2.0, speedup_vs_compile=1.5, sol_candidate=0.6,
        roofline=Roofline(flops=0, bytes=2e9, floor_ms=0.6, bound="memory", bandwidth_gbs=3300, matmul_tflops=60),
        kernels=[KernelTime("small_kernel", 0.1, 1), KernelTime("big_kernel", 0.9, 2)],
    )  # fmt: skip
    verify = VerifyResult(ok=True, trials=[TrialResult(seed=0, ok=True, max_abs_error=1e-6, max_rel_error=1e-5)])
    text = eval_text(EvalResult(problem_id="p", workspace="/w", verify=verify, bench=bench, reward=3))
    lines = text.splitlines()
    assert lines[0].startswith("Profile: reward 3 ")
    assert lines[1].startswith("Verify PASSED: 1/1 trials")
    assert "  candidate     1 ms; 0.98-1.02 ms; 4.0% (50 runs); 60.0% of speed-of-light" in lines
    assert "Speedup: 2.00x vs eager, 1.50x vs torch.compile." in lines
    assert "Speed-of-light floor: 0.6 ms (memory-bound: 2 GB, 0 GFLOP)." in lines
    top = lines.index("Top kernels of the candidate (total ms, calls, share):")
    assert lines[top + 1] == "  0.9 ms  x2  90%  big_kernel" and lines[top + 2] == "  0.1 ms  x1  10%  small_kernel"


def test_a_verifier_failure_is_told_as_the_verifiers_not_the_kernels():
    verify = VerifyResult(ok=False, error_kind="harness", message="kernelpilot's verifier failed, not the candidate: "
                          "KeyError: 'out'", traceback="Traceback (most recent call last): ...")  # fmt: skip
    lines = eval_text(EvalResult(problem_id="p", workspace="/w", verify=verify, error_kind="harness",
                                 message=verify.message)).splitlines()  # fmt: skip
    assert lines[1] == (
        "Verify did not judge the candidate: kernelpilot's verifier failed, not your kernel (0 trials passed before it did)."
    )
    assert lines[2] == verify.message
    assert "FAILED" not in "\n".join(lines) and "Traceback" not in "\n".join(lines)


def test_eval_text_of_a_tampered_workspace_says_why():
    text = eval_text(EvalResult(problem_id="p", workspace="/w", error_kind="tampered", message="model.py was changed."))
    assert text.splitlines()[1] == "tampered: model.py was changed."


# One build on the CPU for the three harness tools: only the protected kp_module.cpp is compiled (with g++), and the
# candidate computes with torch in forward, which the torch-compute guard must reject.
TORCH_CANDIDATE = """
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, features: int = 16):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(features))

    def forward(self, x):
        return x * self.scale
"""

# The run's settings, which Verify and Profile must judge with (the judge's defaults are 5 trials, 1e-2 and 1e-2).
# Only the tolerances show here: the guard stops the torch candidate after its first trial.
RUN_SETTINGS = Settings(trials=3, atol=3e-3, rtol=2e-3)


@pytest.fixture(scope="module")
def judged_on_cpu(tmp_path_factory):
    from kernelpilot.harness.judge import Judge

    ctx = make_workspace(tmp_path_factory.mktemp("judged"))
    root = ctx.workspace.root
    for example in EXAMPLE_KERNELS:
        (root / example).unlink()
    ctx.workspace.model_new_path.write_text(TORCH_CANDIDATE)
    ctx.settings = RUN_SETTINGS
    with Judge("cpu", arch="9.0", cache_dir=tmp_path_factory.mktemp("cache")) as judge:
        ctx.judge = judge
        outputs = {name: call(ctx, name) for name in ("Compile", "Verify", "Profile")}
        good_build = ctx.judged.build
        (root / "kernels" / "broken.cpp").write_text("int broken() {\n  return undefined_name;\n}\n")
        outputs["broken Compile"] = call(ctx, "Compile")
        outputs["broken Verify"] = call(ctx, "Verify", trials=2)
    return ctx, outputs, good_build


@pytest.mark.cuda_build
def test_compile_reports_the_build_and_remembers_it(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    compiled = outputs["Compile"]
    assert compiled.text.startswith("Build ok for sm_90 in ")
    assert "recompiled: kernels/kp_module.cpp." in compiled.text
    assert compiled.data["ok"] and compiled.data["library"]


@pytest.mark.cuda_build
def test_compile_errors_come_back_as_file_line_messages(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    text = outputs["broken Compile"].text
    assert text.startswith("Build FAILED: ")
    assert "Recompiled: kernels/broken.cpp." in text
    assert "kernels/broken.cpp:2:" in text and "undefined_name" in text
    assert not ctx.judged.build.ok, "the latest build is the one remembered"
    assert outputs["broken Verify"].text.startswith("Verify skipped: the build failed.\nBuild FAILED")


@pytest.mark.cuda_build
def test_verify_reports_trials_and_the_torch_compute_guard(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    verified = outputs["Verify"]
    assert verified.text.startswith("Verify FAILED (guard)")
    assert "guard torch-compute [fail]" in verified.text
    assert verified.data["verify"]["ok"] is False and verified.data["build"]["ok"] is True


@pytest.mark.cuda_build
def test_profile_records_the_evaluation_for_the_loop(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    profiled = outputs["Profile"]
    assert profiled.text.startswith("Profile: reward -1 ")
    assert "guard torch-compute [fail]" in profiled.text
    assert isinstance(profiled.result, EvalResult) and ctx.judged.evals == [profiled.result]
    assert profiled.data["reward"] == -1 and profiled.text == eval_text(profiled.result)


@pytest.mark.cuda_build
def test_verify_and_profile_judge_with_the_runs_trials_and_tolerances(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    for judged in (outputs["Verify"].data["verify"], outputs["Profile"].data["verify"]):
        assert (judged["atol"], judged["rtol"]) == (3e-3, 2e-3)
    assert "within |actual - expected| <= 0.003 + 0.002 * |expected|" in outputs["Verify"].text


@pytest.mark.cuda_build
def test_the_ncu_driver_loads_and_runs_the_candidate_the_way_the_harness_does(judged_on_cpu):
    import json

    from kernelpilot.results import to_dict

    ctx, _, good_build = judged_on_cpu
    build_json = ctx.workspace.root / ".kernelpilot" / "tmp" / "build.json"
    build_json.parent.mkdir(parents=True, exist_ok=True)
    build_json.write_text(json.dumps(to_dict(good_build)))
    argv = [sys.executable, "-c", NCU_DRIVER, str(ctx.workspace.root), str(build_json), "cpu"]
    run = run_process(argv, cwd=ctx.workspace.root, env=driver_environment(build_json.parent / "sandbox"), timeout=120)
    assert run.returncode == 0, run.output


def test_the_ncu_driver_runs_the_candidate_confined_like_a_sandbox(tmp_path, monkeypatch):
    """Candidate code under ncu is as confined as in the judge's sandboxes: none of the user's credentials in its
    environment, and (where Landlock exists) no writes outside its private folder."""
    from kernelpilot.harness.confine import landlock_available

    ctx = make_workspace(tmp_path / "ws", scale_shift_problem(rows=4, columns=4))
    outside = tmp_path / "outside.txt"
    ctx.workspace.model_new_path.write_text(
        "import os\nfrom pathlib import Path\n"
        "print('SEEN', sorted(os.environ))\n"
        f"try:\n    Path({str(outside)!r}).write_text('escaped')\nexcept OSError as err:\n    print('BLOCKED', err)\n"
        "from torch import nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x * 2.0 + 1.0\n"
    )
    for source in ctx.workspace.kernel_sources():  # no kernels, so no build: the driver loads model_new.py alone
        source.unlink()
    build_json = tmp_path / "build.json"
    build_json.write_text("null")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-of-the-user")
    argv = [sys.executable, "-c", NCU_DRIVER, str(ctx.workspace.root), str(build_json), "cpu"]
    run = run_process(argv, cwd=ctx.workspace.root, env=driver_environment(tmp_path / "sandbox"), timeout=120)
    assert run.returncode == 0, run.output
    seen = next(line for line in run.output.splitlines() if line.startswith("SEEN"))
    assert "OPENAI_API_KEY" not in seen and "HOME" in seen
    if landlock_available():
        assert "confinement: landlock" in run.output and "BLOCKED" in run.output
        assert not outside.exists()


# -------------------------------------------------------------------------------------------------- GPU

@pytest.fixture(scope="module")
def gpu_ctx(tmp_path_factory):
    from kernelpilot.harness.judge import Judge

    ctx = make_workspace(tmp_path_factory.mktemp("gpu"), scale_shift_problem(rows=4096, columns=4096))
    ctx.workspace.model_new_path.write_text(EXAMPLE_KERNEL_CANDIDATE)
    with Judge(cache_dir=tmp_path_factory.mktemp("cache")) as judge:
        ctx.judge = judge
        yield ctx


@pytest.mark.gpu
def test_gpu_compile_verify_profile_the_example_kernel(gpu_ctx):
    compiled = call(gpu_ctx, "Compile")
    assert compiled.data["ok"], compiled.text
    assert "scale_shift_kernel" in compiled.text and " regs, " in compiled.text
    verified = call(gpu_ctx, "Verify", trials=3)
    assert verified.text.startswith("Verify PASSED: 3/3 trials"), verified.text
    profiled = call(gpu_ctx, "Profile")
    assert profiled.data["reward"] >= 1, profiled.text
    assert "Speedup: " in profiled.text and "% of speed-of-light" in profiled.text
    assert "Top kernels of the candidate" in profiled.text and "scale_shift" in profiled.text
    assert gpu_ctx.judged.evals[-1].reward == profiled.data["reward"]


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="ncu (Nsight Compute) is not on PATH")
def test_gpu_ncu_profiles_the_candidates_kernel(gpu_ctx):
    output = call(gpu_ctx, "Ncu", kernel="scale_shift")
    assert output.data["available"], output.text
    assert output.text.startswith("ncu: 1 kernel launch(es) in one forward call:"), output.text
    assert "scale_shift_kernel" in output.text and "DRAM " in output.text and " us, " in output.text
