"""Links and file names planted in the workspace against the writes of the trusted side (issue #14).

The agent's Bash commands may write only inside the workspace (Landlock), but a link they make there may lead
anywhere, and the judge's worker, which builds, is not confined: a build that wrote build/build.ninja through a link
the agent made to a .pth file in site-packages overwrote it with build.ninja's text, and a kernel file named
"q\\nimport os;exec(...)#.cpp" put a line of the agent's choosing into that text, which Python would then run in every
later kernelpilot process, the judge's own included. Against kernelpilot as it was (8e95aa1), every test here failed
but the two that check what held already (plain names with spaces are sources; build/versions as a link is refused):
the files outside were written, and build.ninja held the name's `import os;exec(...)` line.

Every write the trusted side makes in a workspace folder (the build folder's files and folders, .kernelpilot/, the
lock file, the files `init` writes) replaces a link rather than writing where it leads, or refuses a link where a
folder is expected; and a kernel file whose name ninja or the generated files cannot carry is refused by name.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from kernelpilot.agent import ToolContext
from kernelpilot.agent.tools import default_tools
from kernelpilot.errors import WorkspaceError
from kernelpilot.harness.confine import landlock_available
from kernelpilot.workspace import Workspace, init_workspace
from kp_testing import nonempty, scale_problem, write_problem

ARCH = "9.0"
BASH = next(tool for tool in default_tools() if tool.name == "Bash")
VICTIM_TEXT = "# a file outside the workspace: site-packages, the judge's cache, another trajectory's workspace\n"


def _workspace(folder: Path) -> Workspace:
    ws, _ = init_workspace(write_problem(folder, scale_problem(rows=8, features=16)), folder / "ws")
    return ws


def _plant(ws: Workspace, script: str) -> None:
    """Run `script` (Python) in the workspace as the agent would: a file it writes, run by its Bash tool, whose
    programs may write only inside the workspace where the kernel has Landlock (elsewhere, as a plain process)."""
    (ws.root / "plant.py").write_text(script)
    try:
        if landlock_available():
            output = BASH.run({"command": "python3 plant.py", "timeout_s": 60}, ToolContext(workspace=ws, judge=None))
            assert output.data["exit_code"] == 0, output.text
        else:
            subprocess.run([sys.executable, "plant.py"], cwd=ws.root, check=True, timeout=60)
    finally:
        (ws.root / "plant.py").unlink()


def _link_script(links: dict[str, Path]) -> str:
    """A script that makes each workspace path (relative) a link to its target, whatever is there now."""
    return "import os, shutil\n" + "".join(
        f"p = {relative!r}\nos.makedirs(os.path.dirname(p) or '.', exist_ok=True)\n"
        f"shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else None\n"
        f"os.unlink(p) if os.path.lexists(p) else None\nos.symlink({str(target)!r}, p)\n"
        for relative, target in links.items()
    )


def _outside(tmp_path: Path) -> Path:
    """A folder outside the workspace with a file in it (a site-packages folder, say) and an empty folder."""
    folder = tmp_path / "outside"
    (folder / "site").mkdir(parents=True, exist_ok=True)
    (folder / "empty").mkdir(exist_ok=True)
    (folder / "site" / "zz_kp.pth").write_text(VICTIM_TEXT)
    return folder


def _snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder` with the SHA-256 of its content (folders: "folder")."""
    return {
        path.relative_to(folder).as_posix(): "folder" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
    }


# ----------------------------------------------------------------------------------- the judge's build


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A scaffolded workspace, a CPU judge with a cache of its own, and the judge's build of the workspace."""
    from kernelpilot.harness.judge import Judge

    folder = tmp_path_factory.mktemp("links")
    ws = _workspace(folder)
    with Judge("cpu", arch=ARCH, cache_dir=folder / "judge-cache") as judge:
        assert judge.build(ws.root).ok
        yield judge, ws


@pytest.mark.cuda_build
def test_a_link_planted_at_build_ninja_is_replaced_not_written_through(judged, tmp_path):
    judge, ws = judged
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    _plant(ws, _link_script({"build/build.ninja": outside / "site" / "zz_kp.pth"}))
    assert (ws.root / "build" / "build.ninja").is_symlink(), "the agent's Bash could not plant the link"

    build = judge.build(ws.root)

    assert _snapshot(outside) == before, "the judge's build wrote through a link to a file outside the workspace"
    ninja_file = ws.root / "build" / "build.ninja"
    assert not ninja_file.is_symlink() and ninja_file.read_text().startswith("# Written by kernelpilot")
    assert build.ok, build.error


@pytest.mark.cuda_build
def test_links_planted_where_the_judges_build_writes_its_files_lead_nowhere(judged, kernel, tmp_path):
    """The files a build writes (build.ninja, the lock, ninja's log, a ptxas report) and the folder its builds ahead
    are made in, each a link out of the workspace; the kernel edited, so that it compiles and reports."""
    judge, ws = judged
    outside = _outside(tmp_path)
    report = f"build/resources/{kernel.name}.json"
    links = {
        "build/build.ninja": outside / "site" / "zz_kp.pth",
        "build/build.lock": outside / "site" / "created.pth",  # a file that is not there yet
        "build/.ninja_log": outside / "site" / "ninja_log",
        report: outside / "site" / "report.json",
        "build/ahead": outside / "empty",
    }
    before = _snapshot(outside)
    _plant(ws, _link_script(links))
    kernel.write_text(kernel.read_text() + "\n// edited: compiled again\n")
    ahead = {kernel.relative_to(ws.root).as_posix(): kernel.read_text() + "\n// a version built ahead\n"}

    build = judge.build(ws.root, ahead=[ahead])

    assert _snapshot(outside) == before, "the judge's build wrote through a link out of the workspace"
    assert build.ok, build.error
    assert build.ahead is not None and build.ahead.built == 1, build.ahead
    for relative in links:
        assert not (ws.root / relative).is_symlink(), f"{relative} is still the agent's link"
    assert (ws.root / report).is_file()


@pytest.mark.cuda_build
def test_a_kernel_file_named_with_a_newline_writes_no_line_of_its_choosing(judged, tmp_path):
    judge, ws = judged
    payload = ws.root / "payload.txt"
    payload.write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').write('ran')\n")
    # The red-team's name: a line of Python after the newline (the payload's path spelled without a slash, which no
    # file name can hold), `#` to comment out what follows it (".cpp").
    name = f"q\nimport os;exec(open(chr(47).join({str(payload).split('/')!r})).read())#.cpp"
    _plant(ws, f"open('kernels/' + {name!r}, 'w').write('// empty\\n')\n")
    assert (ws.root / "kernels" / name).is_file(), "the agent's Bash could not make the file"
    try:
        with pytest.raises(WorkspaceError) as raised:
            judge.build(ws.root)
        verdict = judge.evaluate(ws.root, trials=1, bench=False)
    finally:
        (ws.root / "kernels" / name).unlink()
        payload.unlink()

    written = [path for path in (ws.root / "build").rglob("*") if path.is_file() and not path.is_symlink()]
    lines = [line for path in nonempty(written, "build files") for line in path.read_bytes().splitlines()]
    assert not [line for line in lines if line.startswith(b"import os")], "a line of the build's text is a file name"
    assert "kernels/q\\nimport os" in raised.value.message and "rename" in raised.value.hint, raised.value
    # To the judge's verdict the name is the candidate's, as a compile error is.
    assert (verdict.error_kind, verdict.reward) == ("build", -1) and "kernels/q\\nimport os" in verdict.message
    assert not (tmp_path / "PWNED").exists()


# ------------------------------------------------------------------------------------------- file names


@pytest.mark.parametrize("character", ["\n", "\r", "\t", "\x1b", "\x7f", "\u2028", "\x85", "\u200b"])
def test_a_kernel_file_name_with_a_control_character_is_refused_in_one_sentence(tmp_path, character):
    kernels = tmp_path / "ws" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "good.cu").write_text("// fine\n")
    (kernels / f"bad{character}name.cpp").write_text("// refused\n")

    with pytest.raises(WorkspaceError) as raised:
        Workspace(tmp_path / "ws").kernel_sources()

    assert repr(f"kernels/bad{character}name.cpp") in raised.value.message, raised.value.message
    assert raised.value.hint and "rename" in raised.value.hint


def test_a_header_with_a_control_character_in_its_name_is_refused_too(tmp_path):
    """Headers are not compiled, but their names reach ninja's deps and the build's records all the same."""
    kernels = tmp_path / "ws" / "kernels" / "include"
    kernels.mkdir(parents=True)
    (kernels.parent / "k.cu").write_text("// fine\n")
    (kernels / "x\ny.h").write_text("// refused\n")

    with pytest.raises(WorkspaceError, match="in its name, which the build cannot carry"):
        Workspace(tmp_path / "ws").kernel_sources()


def test_plain_names_with_spaces_and_dollars_are_still_sources(tmp_path):
    kernels = tmp_path / "ws" / "kernels"
    kernels.mkdir(parents=True)
    for name in ("my kernel.cu", "cost$1.cpp", "ünïcode.cu"):
        (kernels / name).write_text("// fine\n")
    assert [p.name for p in Workspace(tmp_path / "ws").kernel_sources()] == ["cost$1.cpp", "my kernel.cu", "ünïcode.cu"]


# ------------------------------------------------------------------------------ versions and records


def test_a_version_folder_planted_as_a_link_is_refused_not_published_through(tmp_path):
    """The next version's folder is named by its library's content, which an agent that links the same objects
    can know: a link there would have the library written wherever it leads."""
    from kernelpilot.build_versions import publish_version

    outside = _outside(tmp_path)
    before = _snapshot(outside)
    build_dir = tmp_path / "ws" / "build"
    build_dir.mkdir(parents=True)
    library = build_dir / "kp_kernels.so"
    library.write_bytes(b"the library the build linked")
    folder = build_dir / "versions" / hashlib.sha256(library.read_bytes()).hexdigest()[:16]
    folder.parent.mkdir()
    folder.symlink_to(outside / "empty")

    with pytest.raises(WorkspaceError, match="is a link"):
        publish_version(build_dir)
    assert _snapshot(outside) == before


def test_files_planted_as_links_in_a_version_folder_are_replaced(tmp_path):
    from kernelpilot.build_versions import SOURCES_RECORD, publish_version, record_sources
    from kernelpilot.harness.cache import MemoryCache

    outside = _outside(tmp_path)
    before = _snapshot(outside)
    build_dir = tmp_path / "ws" / "build"
    build_dir.mkdir(parents=True)
    (build_dir / "kp_kernels.so").write_bytes(b"the library the build linked")
    folder = build_dir / "versions" / hashlib.sha256(b"the library the build linked").hexdigest()[:16]
    folder.mkdir(parents=True)
    for name in ("kp_kernels.so", "kp_kernels.so.partial", SOURCES_RECORD, f"{SOURCES_RECORD}.partial"):
        (folder / name).symlink_to(outside / "site" / "zz_kp.pth")

    version = publish_version(build_dir)
    record_sources(version.parent, "key", [], MemoryCache())

    assert _snapshot(outside) == before
    assert version.read_bytes() == b"the library the build linked" and not version.is_symlink()
    assert not (folder / SOURCES_RECORD).is_symlink() and "key" in (folder / SOURCES_RECORD).read_text()


def test_a_lock_file_planted_as_a_link_is_replaced(tmp_path):
    from kernelpilot.build import build_lock

    outside = _outside(tmp_path)
    build_dir = tmp_path / "ws" / "build"
    build_dir.mkdir(parents=True)
    (build_dir / "build.lock").symlink_to(outside / "site" / "created.pth")

    with build_lock(build_dir, timeout_s=5):
        pass

    assert not (outside / "site" / "created.pth").exists()
    assert (build_dir / "build.lock").is_file() and not (build_dir / "build.lock").is_symlink()


@pytest.mark.parametrize("link", ["build/resources", "build/versions"])
def test_a_build_folder_linked_out_is_refused_before_anything_is_built(tmp_path, link):
    from kernelpilot.build import build_workspace

    outside = _outside(tmp_path)
    before = _snapshot(outside)
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "k.cpp").write_text("int k() { return 1; }\n")
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(outside / "empty")

    with pytest.raises(WorkspaceError, match="is a link"):
        build_workspace(root, arch=ARCH)
    assert _snapshot(outside) == before


# --------------------------------------------------------------------- .kernelpilot/, the lock, init


def test_the_accepted_lock_planted_as_a_link_is_replaced(tmp_path):
    from kernelpilot.lockfile import Environment, Lock, Timings, Verification, file_hashes, lock_path, write_lock

    ws = _workspace(tmp_path)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    _plant(ws, _link_script({lock_path(ws).relative_to(ws.root).as_posix(): outside / "site" / "zz_kp.pth"}))
    lock = Lock(problem_id=ws.problem_id, environment=Environment(gpu="cpu", torch="2", cuda=None),
                verification=Verification(atol=1e-2, rtol=1e-2), timings=Timings(bench_seed=1), reward=1,
                files=file_hashes(ws))  # fmt: skip

    write_lock(ws, lock)

    assert _snapshot(outside) == before
    assert not lock_path(ws).is_symlink() and ws.problem_id in lock_path(ws).read_text()


def test_the_transcript_and_the_best_copy_planted_as_links_are_not_written_through(tmp_path):
    from kernelpilot.agent.session import BEST_DIR, Session, save_best
    from kernelpilot.results import EvalResult, VerifyResult

    ws = _workspace(tmp_path)
    outside = _outside(tmp_path)
    session = Session.create(ws.root, problem=str(ws.model_path), model="builtin")
    transcript = session.path.read_text()
    before = _snapshot(outside)
    _plant(ws, _link_script({session.path.relative_to(ws.root).as_posix(): outside / "site" / "zz_kp.pth",
                             BEST_DIR: outside / "empty"}))  # fmt: skip
    verdict = EvalResult(problem_id=ws.problem_id, workspace=str(ws.root), verify=VerifyResult(ok=True), reward=1)

    digest = session.append_vouched("eval", turn=1, eval=verdict, improved=True)
    save_best(ws, session.path, digest)

    assert _snapshot(outside) == before, "the agent's process wrote through a link out of the workspace"
    assert not session.path.is_symlink() and '"eval"' in session.path.read_text() and transcript
    assert (ws.root / BEST_DIR / "model_new.py").is_file() and not (ws.root / BEST_DIR).is_symlink()


def test_pristine_copies_are_not_written_through_a_linked_folder(tmp_path):
    from kernelpilot.agent.tools.shell import PRISTINE_DIR, keep_pristine_copies

    ws = _workspace(tmp_path)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    _plant(ws, _link_script({PRISTINE_DIR: outside / "empty"}))

    keep_pristine_copies(ws)  # what the Bash tool does before each command

    assert _snapshot(outside) == before
    # The folder is kernelpilot's alone: the link is dropped (not what it leads to) and the copies made again.
    assert not (ws.root / PRISTINE_DIR).is_symlink() and (ws.root / PRISTINE_DIR / "model.py").is_file()


def test_init_again_replaces_links_where_it_writes_missing_files(tmp_path):
    """`init` of an existing workspace writes back the protected files and model_new.py that are missing: a dangling
    link is missing to `exists()`, and writing it creates the file it leads to."""
    problem = write_problem(tmp_path, scale_problem(rows=8, features=16))
    ws, _ = init_workspace(problem, tmp_path / "ws")
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    _plant(ws, _link_script({"model_new.py": outside / "site" / "model_new.py"}))
    # The Bash tool puts a protected file back after each command; a clone or a copy may hold such a link all the same.
    (ws.root / "kernels" / "kp_cuda.h").unlink()
    (ws.root / "kernels" / "kp_cuda.h").symlink_to(outside / "site" / "kp_cuda.h")

    _, written = init_workspace(problem, ws.root)

    assert _snapshot(outside) == before
    assert sorted(written) == ["kernels/kp_cuda.h", "model_new.py"]
    assert not (ws.root / "model_new.py").is_symlink() and not (ws.root / "kernels" / "kp_cuda.h").is_symlink()


def test_the_agents_compile_answers_a_refused_name_as_an_observation(tmp_path):
    """The model made the name, and can rename it: its Compile call gets the sentence back, and the run goes on."""
    from kernelpilot.agent import RecoverableError
    from kernelpilot.build import kernel_sources

    class CheckingJudge:  # the judge's worker checks the names the same way before it builds
        device = "cpu"

        def build(self, root, ahead=None):
            kernel_sources(Workspace(root))

    ws = _workspace(tmp_path)
    (ws.root / "kernels" / "a\nb.cu").write_text("// refused\n")
    compile_tool = next(tool for tool in default_tools() if tool.name == "Compile")

    with pytest.raises(RecoverableError, match=r"Compile: The kernel file 'kernels/a\\nb.cu' has .* Hint: rename it"):
        compile_tool.run({}, ToolContext(workspace=ws, judge=CheckingJudge()))


def test_a_kernel_file_planted_as_a_link_out_is_not_copied_into_the_users_folder(tmp_path):
    """A link under kernels/ to a file outside (a key, a token) is not the candidate's file: its content is not kept
    with the best candidate nor copied beside the user's problem (where `optimize --commit` would commit it)."""
    from kernelpilot.agent.session import Session, save_best
    from kernelpilot.optimize import write_outputs
    from kernelpilot.results import EvalResult, VerifyResult

    ws = _workspace(tmp_path)
    secret = tmp_path / "outside" / "token.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("SECRET-TOKEN-4242\n")
    _plant(ws, _link_script({"kernels/notes.txt": secret}))
    session = Session.create(ws.root, problem=str(ws.model_path), model="builtin")
    verdict = EvalResult(problem_id=ws.problem_id, workspace=str(ws.root), verify=VerifyResult(ok=True), reward=1)
    save_best(ws, session.path, session.append_vouched("eval", turn=1, eval=verdict, improved=True))

    project = tmp_path / "project"
    write_outputs(ws, ws.model_path, project / "model_new.py", session.path)

    leaked = [p for p in project.rglob("*") if p.is_file() and "SECRET-TOKEN-4242" in p.read_text(errors="replace")]
    assert not leaked, leaked
    with pytest.raises(WorkspaceError) as raised:  # and the build names it
        ws.kernel_sources()
    assert "kernels/notes.txt" in raised.value.message and "link" in raised.value.message, raised.value.message
