"""The file tools on real scaffolded workspaces: Glob, Read, Write and MultiEdit, their typed results and how the
model reads them, and the path guard (nothing outside the workspace, only the files the agent may edit written)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tools_testing import call

from kernelpilot.agent import RecoverableError
from kernelpilot.agent.observations import edited_text, glob_text, read_text, written_text
from kernelpilot.agent.session import tool_result
from kernelpilot.agent.tool_results import FileEdited, FileRead, FileWritten, GlobMatches
from kernelpilot.agent.tools.files import GLOB_LIMIT


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


def test_writing_what_a_file_already_holds_leaves_it_untouched(ctx):
    """So the incremental build does not recompile it: the policy writes every kernel of each configuration it
    tries, and most of them are the same as before."""
    path = ctx.workspace.root / "kernels" / "softmax.cu"
    call(ctx, "Write", path="kernels/softmax.cu", content="// v1\n")
    os.utime(path, (1_000_000, 1_000_000))
    same = call(ctx, "Write", path="kernels/softmax.cu", content="// v1\n")
    assert same.text == "Left kernels/softmax.cu as it was: it already holds this content (1 lines)."
    assert same.data["unchanged"] and not same.data["created"] and same.data["diff"] == ""
    assert path.stat().st_mtime == 1_000_000
    changed = call(ctx, "Write", path="kernels/softmax.cu", content="// v2\n")
    assert changed.text.startswith("Overwrote") and not changed.data["unchanged"]
    assert path.stat().st_mtime > 1_000_000


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


# --------------------------------------------------------------------------------------------- typed results


def transcript_record(tool_name: str, output) -> dict:
    """The `tool` record the loop writes for `output` (the parts `session.tool_result` reads)."""
    return {"type": "tool", "name": tool_name, "result_type": type(output.result).__name__, "data": output.data}


def test_glob_returns_typed_matches_that_the_model_reads_as_a_listing(ctx):
    output = call(ctx, "Glob", pattern="kernels/*")
    matches = output.result
    assert isinstance(matches, GlobMatches) and matches.pattern == "kernels/*"
    assert "kernels/kp_module.cpp" in matches.matches and matches.total == len(matches.matches)
    assert output.text == glob_text(matches) == "\n".join(matches.matches)
    assert tool_result(transcript_record("Glob", output)) == matches
    capped = GlobMatches("*.cu", ["a.cu", "b.cu"], total=5)
    assert glob_text(capped) == "a.cu\nb.cu\n(showing 2 of 5 matches; narrow the pattern to see the rest)"


def test_read_returns_the_lines_it_shows_typed_and_the_model_reads_them_numbered(ctx):
    notes = ctx.workspace.root / "notes"
    notes.mkdir()
    (notes / "lines.md").write_text("".join(f"line {n}\n" for n in range(1, 11)))
    (notes / "empty.md").write_text("")
    output = call(ctx, "Read", path="notes/lines.md", offset=3, limit=2)
    assert output.result == FileRead("notes/lines.md", offset=3, last_line=4, line_count=10, shown=["line 3", "line 4"])
    assert output.text == read_text(output.result)
    # The lines themselves stay in the tool message; the transcript's data says which ones they were.
    assert output.data == {"path": "notes/lines.md", "offset": 3, "last_line": 4, "line_count": 10}
    empty = call(ctx, "Read", path="notes/empty.md")
    assert empty.result == FileRead("notes/empty.md") and empty.text == "notes/empty.md is empty."


def test_write_and_multiedit_return_typed_changes_with_their_diffs(ctx):
    written = call(ctx, "Write", path="kernels/a.cu", content="int a = 1;\n")
    assert written.result == FileWritten("kernels/a.cu", created=True, lines=1, diff=written.result.diff)
    assert "+int a = 1;" in written.result.diff
    assert written.text == written_text(written.result) == "Created kernels/a.cu (1 lines)."
    edited = call(ctx, "MultiEdit", path="kernels/a.cu", edits=[{"old_string": "= 1", "new_string": "= 2"}])
    assert edited.result == FileEdited("kernels/a.cu", edits=1, added=1, removed=1, diff=edited.result.diff)
    assert "-int a = 1;\n+int a = 2;\n" in edited.result.diff
    assert edited.text == edited_text(edited.result) == "Applied 1 edit(s) to kernels/a.cu (+1 -1 lines)."
    assert tool_result(transcript_record("Write", written)) == written.result
    assert tool_result(transcript_record("MultiEdit", edited)) == edited.result
