"""Scaffold a task workspace from templates/ and guard its protected files with a SHA-256 manifest.

The layout is described in docs/ARCHITECTURE.md. Protected files are kernelpilot's (the reference, the
binding infrastructure, the build and benchmark scripts, the rules); everything else is the user's or
the agent's, and `init` never overwrites it. The manifest also holds the workspace's torch namespace, under
which its kernels are registered as custom operators (`kernelpilot.ops`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kernelpilot.errors import WorkspaceError
from kernelpilot.problem_signatures import ModelSignatures, model_signatures
from kernelpilot.resources import data_dir, template_environment
from kernelpilot.workspace_files import is_plain_file, write_file

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

EXTENSION_NAME = "kp_kernels"  # the built library: build/kp_kernels.so
PROTECTED_FILES = (
    "model.py",
    "setup.py",
    "benchmark.py",
    "SKILL.md",
    "kernels/kp_registry.h",
    "kernels/kp_module.cpp",
    "kernels/kp_cuda.h",
)
# Why the agent may not change the protected files, as its tools tell it.
PROTECTED_REASON = "it is kernelpilot's (the reference or the build infrastructure) and must stay unchanged"
MANIFEST_VERSION = 2  # 2: kernels are torch custom operators under the manifest's "namespace"
MANIFEST_PATH = ".kernelpilot/manifest.json"
MODEL_NEW_TEMPLATE = "model_new.py.j2"
# Starter files the user edits or deletes: written only into a new workspace, so that a re-run of
# `init` never brings back an example the user removed on purpose.
EXAMPLE_KERNELS = ("kernels/example_scale_shift.cu", "kernels/example_scale_shift_binding.cpp")
# Keeps build/ and .kernelpilot/ (all but the manifest) out of git; like the examples, the user's to change.
GITIGNORE_PATH = ".gitignore"
GITIGNORE_TEMPLATE = "gitignore"  # no dot in templates/, where git would apply it to kernelpilot's own checkout
_INIT_HINT = "Run `kernelpilot init PROBLEM.py` to create a workspace, then pass the folder it made."
# A torch library namespace: a Python identifier, so `torch.ops.<namespace>` reads it.
NAMESPACE_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class Workspace:
    """A task folder made by `init_workspace`: the reference, ModelNew, kernels/ and the build folder."""

    root: Path

    @property
    def model_path(self) -> Path:
        return self.root / "model.py"

    @property
    def model_new_path(self) -> Path:
        return self.root / "model_new.py"

    @property
    def kernels_dir(self) -> Path:
        return self.root / "kernels"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_PATH

    @property
    def problem_id(self) -> str:
        """The content hash of the problem this workspace was made for (from the manifest)."""
        return _read_manifest(self)["problem_id"]

    @property
    def namespace(self) -> str:
        """The torch namespace of this workspace's ops (`torch.ops.<namespace>`): the manifest's, or for a folder
        with kernels/ and no manifest (tests and scripts build those), one derived from its path."""
        if self.manifest_path.is_file():
            return _read_manifest(self)["namespace"]
        return f"kp_{_slug(self.root.name)}_{hashlib.sha256(str(self.root).encode()).hexdigest()[:6]}"

    def kernel_sources(self) -> list[Path]:
        """The sources compiled into the extension: kernels/*.cu and kernels/*.cpp, sorted. WorkspaceError for a
        file under kernels/ whose name the build cannot carry (`check_kernel_names`)."""
        check_kernel_names(self.kernels_dir)
        return sorted([*self.kernels_dir.glob("*.cu"), *self.kernels_dir.glob("*.cpp")])

    def problem(self) -> Problem:
        """The reference problem, loaded from this workspace's model.py."""
        from kernelpilot.problem import load_problem

        return load_problem(self.model_path)


def check_kernel_names(kernels_dir: Path) -> None:
    """Refuse, in one sentence, a file or folder under `kernels_dir` whose name holds a character that is not
    printable (a newline, a tab, an escape, a line separator, ...) or `|`, or that is a link (what it leads to,
    outside the workspace, would be built, kept with the best candidate and copied out as the candidate's own).

    The names become lines and paths in text kernelpilot and ninja write (build.ninja, ninja's log and deps, the
    build's log and records), all read line by line: a newline in a name would start a line of its writer's choosing
    there (tests/adversarial/test_planted_links.py), and `|` ends a path in build.ninja, where nothing escapes it.
    """
    for path in sorted(kernels_dir.rglob("*")):
        relative = path.relative_to(kernels_dir.parent).as_posix()
        unsafe = next((char for char in relative if not char.isprintable() or char == "|"), None)
        if unsafe is not None:
            raise WorkspaceError(
                f"The kernel file {relative!r} has {unsafe!r} in its name, which the build cannot carry in its files.",
                hint="rename it to a plain name (letters, digits, '.', '-', '_'); only then is the workspace built",
            )
        if path.is_symlink():
            raise WorkspaceError(
                f"The kernel file {relative!r} is a link: kernelpilot builds, keeps and copies out only plain files "
                "of the workspace's own.",
                hint="replace the link with a copy of the file it leads to",
            )


def init_workspace(
    problem_path: Path | str, dest: Path | None = None, *, device: str | None = None
) -> tuple[Workspace, list[str]]:
    """Create (or complete) the workspace for a problem; return it and the relative paths written.

    The problem file is first loaded in a child process with a time and a memory limit (or was, with the same
    content, limits and device: that check is reused), and must fit `device` (None: the judge's default GPU), so a
    file that hangs, crashes or is too large leaves no workspace behind.
    An existing workspace of the same problem gets its missing protected files back; nothing the user may
    edit is overwritten. A workspace of another problem, or one whose protected files were changed, is
    refused with a WorkspaceError.
    """
    from kernelpilot.problem_check import check_problem

    problem_path = Path(problem_path)
    # The check reports the id and Model's signatures: this process never runs the file.
    check = check_problem(problem_path, device=device)
    ws = Workspace(workspace_root(problem_path, dest))
    is_new = _prepare_root(ws, check.problem_id)
    # Rendered before anything is written, so a problem it cannot handle leaves no half-made workspace.
    model_new = model_new_source(check.name, check.signatures)
    try:
        return ws, _scaffold(ws, check.path, check.problem_id, model_new, is_new)
    except OSError as err:
        raise WorkspaceError(
            f"Cannot write the workspace {ws.root}: {err.strerror or err}.", hint="Pass a writable folder with --dir."
        ) from None


def new_namespace(problem_name: str) -> str:
    """A namespace for a new workspace: `kp_<problem name>_<6 random hex digits>`. Random rather than derived from
    the path, so two workspaces of one problem differ and a moved or cloned workspace keeps its own."""
    return f"kp_{_slug(problem_name)}_{secrets.token_hex(3)}"


def _slug(name: str) -> str:
    """`name` as lower-case letters, digits and single underscores, at most 24 characters ("ws" when none is left)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:24].strip("_") or "ws"


def workspace_root(problem_path: Path | str, dest: Path | None = None) -> Path:
    """The folder `init_workspace` uses for a problem: `dest`, else ./kp-<problem file's stem>, resolved."""
    root = Path(dest) if dest is not None else Path.cwd() / f"kp-{Path(problem_path).stem}"
    return root.expanduser().resolve()


def open_workspace(root: Path | str) -> Workspace:
    """The workspace at `root`; WorkspaceError when the folder was not made by `kernelpilot init`."""
    ws = Workspace(Path(root).expanduser().resolve())
    if not ws.root.is_dir():
        raise WorkspaceError(f"Workspace folder {ws.root} does not exist.", hint=_INIT_HINT)
    _read_manifest(ws)
    return ws


def tampered_files(ws: Workspace) -> list[str]:
    """Protected files that are missing or whose SHA-256 differs from what kernelpilot made the workspace with, in
    PROTECTED_FILES order, then the manifest where it disagrees with that. What it was made with is the signed record
    in kernelpilot's cache folder, which the agent cannot write (`workspace_record.py`), else the manifest."""
    manifest = _read_manifest(ws)
    trusted = _trusted(ws, manifest)
    tampered = [
        name
        for name in PROTECTED_FILES
        if (ws.root / name).is_symlink()  # kernelpilot never makes one, and its target may change after the check
        or not (ws.root / name).is_file()
        or trusted["files"].get(name) != _sha256(ws.root / name)
    ]
    if (manifest["problem_id"], manifest["files"]) != (trusted["problem_id"], trusted["files"]):
        tampered.append(MANIFEST_PATH)
    return tampered


def _trusted(ws: Workspace, manifest: dict) -> dict:
    """The workspace's signed record ({"problem_id", "files"}) where it has one, else its manifest."""
    from kernelpilot.workspace_record import stored_record

    return stored_record(ws.root) or manifest


def check_protected(ws: Workspace) -> None:
    """Raise WorkspaceError naming every protected file that was changed or deleted."""
    tampered = tampered_files(ws)
    if tampered:
        raise WorkspaceError(
            f"Protected workspace files were changed or deleted: {', '.join(tampered)}.",
            hint="Restore them (a deleted one comes back with `kernelpilot init PROBLEM.py --dir "
            f"{ws.root}`); put your code in kernels/ and model_new.py instead.",
        )


def render_model_new(problem: Problem, forward_body: str | None = None) -> str:
    """The source of model_new.py: ModelNew with Model's constructor and forward signatures.

    `forward_body` (indented source lines) replaces the placeholder forward; the built-in policy passes its own.
    """
    return model_new_source(problem.name, model_signatures(problem), forward_body)


def model_new_source(problem_name: str, signatures: ModelSignatures, forward_body: str | None = None) -> str:
    """`render_model_new` from the signatures alone, as the problem's check reports them."""
    return template_environment("templates").get_template(MODEL_NEW_TEMPLATE).render(
        problem_name=problem_name,
        init_signature=signatures.init_signature,
        init_call=signatures.init_call,
        forward_signature=signatures.forward_signature,
        uses_model_defaults=signatures.uses_model_defaults,
        forward_body=forward_body,
    )


# ----------------------------------------------------------------------------------------- scaffold


def _prepare_root(ws: Workspace, problem_id: str) -> bool:
    """Check that `ws.root` may be (re)initialised for `problem_id`; return True when it is a new workspace."""
    root = ws.root
    if root.exists() and not root.is_dir():
        raise WorkspaceError(f"{root} is a file, not a folder.", hint="Pass a folder with --dir.")
    if not ws.manifest_path.exists():
        if root.exists() and any(root.iterdir()):
            raise WorkspaceError(
                f"{root} already has files and is not a kernelpilot workspace.",
                hint="Pass an empty or new folder with --dir.",
            )
        return True
    manifest = _read_manifest(ws)
    if _trusted(ws, manifest)["problem_id"] != problem_id:
        raise WorkspaceError(
            f"{root} is the workspace of a different problem.",
            hint="Pass a new folder with --dir, or the problem file this workspace was made from.",
        )
    # A manifest that disagrees with the signed record is written anew from the files, once they agree with it.
    changed = [name for name in tampered_files(ws) if (root / name).exists() and name != MANIFEST_PATH]
    if changed:
        raise WorkspaceError(
            f"Protected files in {root} were changed: {', '.join(changed)}.",
            hint="Restore them, or delete them and run init again to re-create them.",
        )
    return False


def _scaffold(ws: Workspace, problem_path: Path, problem_id: str, model_new_source: str, is_new: bool) -> list[str]:
    """Write what the workspace lacks; return the relative paths written."""
    ws.root.mkdir(parents=True, exist_ok=True)
    created = _write_protected_files(ws, problem_path)
    if is_new or not ws.model_new_path.exists():
        write_file(ws.model_new_path, model_new_source, ws.root)
        created.append("model_new.py")
    if is_new:
        created += _copy_templates(EXAMPLE_KERNELS, ws.root)
        write_file(ws.root / GITIGNORE_PATH, (data_dir("templates") / GITIGNORE_TEMPLATE).read_bytes(), ws.root)
        created.append(GITIGNORE_PATH)
    if _write_manifest(ws, problem_id, problem_path):
        created.append(MANIFEST_PATH)
    return created


def _write_protected_files(ws: Workspace, problem_path: Path) -> list[str]:
    """Write the protected files that are missing; return their relative paths."""
    created = []
    if not ws.model_path.exists():
        # Read-only: a reminder to people and agents that the reference is not theirs to edit.
        write_file(ws.model_path, problem_path.read_bytes(), ws.root, mode=0o444)
        created.append("model.py")
    skill = data_dir("skills") / "SKILL.md"
    if not (ws.root / "SKILL.md").exists():
        write_file(ws.root / "SKILL.md", skill.read_bytes(), ws.root)
        created.append("SKILL.md")
    from_templates = [name for name in PROTECTED_FILES if name not in ("model.py", "SKILL.md")]
    created += _copy_templates([name for name in from_templates if not (ws.root / name).exists()], ws.root)
    return created


def _copy_templates(names: Sequence[str], root: Path) -> list[str]:
    """Copy templates/<name> to root/<name> for each relative path; return the names."""
    templates = data_dir("templates")
    for name in names:
        write_file(root / name, (templates / name).read_bytes(), root)
    return list(names)


def _write_manifest(ws: Workspace, problem_id: str, problem_path: Path) -> bool:
    """Record the hashes of the protected files as they are now, and the namespace; True when the manifest changed."""
    # A workspace keeps its namespace for good: init again, a clone or a move never changes it.
    namespace = ws.namespace if ws.manifest_path.exists() else new_namespace(problem_path.stem)
    manifest = {
        "version": MANIFEST_VERSION,
        "problem_id": problem_id,
        "extension": EXTENSION_NAME,
        "namespace": namespace,
        "files": {name: _sha256(ws.root / name) for name in PROTECTED_FILES},
    }
    text = json.dumps(manifest, indent=2) + "\n"
    from kernelpilot.workspace_record import store_record, stored_record

    if stored_record(ws.root) != {"problem_id": problem_id, "files": manifest["files"]}:
        store_record(ws.root, problem_id, manifest["files"])
    if is_plain_file(ws.manifest_path) and ws.manifest_path.read_text() == text:
        return False
    write_file(ws.manifest_path, text, ws.root)
    return True


def _read_manifest(ws: Workspace) -> dict:
    """The parsed manifest; WorkspaceError when it is missing or not one of ours."""
    try:
        manifest = json.loads(ws.manifest_path.read_text())
    except FileNotFoundError:
        raise WorkspaceError(f"{ws.root} is not a kernelpilot workspace (no {MANIFEST_PATH}).", hint=_INIT_HINT) from None
    except (OSError, ValueError) as err:
        raise WorkspaceError(
            f"The workspace manifest {ws.manifest_path} cannot be read ({err}).",
            hint="Re-create the workspace with `kernelpilot init PROBLEM.py` in a new folder.",
        ) from None
    well_formed = (
        isinstance(manifest, dict)
        and manifest.get("version") == MANIFEST_VERSION
        and isinstance(manifest.get("problem_id"), str)
        and isinstance(manifest.get("files"), dict)
        and NAMESPACE_PATTERN.fullmatch(str(manifest.get("namespace"))) is not None
    )
    if not well_formed:
        raise WorkspaceError(
            f"The workspace manifest {ws.manifest_path} is not a version-{MANIFEST_VERSION} kernelpilot manifest.",
            hint="Re-create the workspace with this kernelpilot's `kernelpilot init PROBLEM.py` in a new folder.",
        )
    return manifest


def _sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def display_path(path: Path) -> str:
    """`path` relative to the current folder when it is inside it, else absolute."""
    absolute = path.resolve()
    try:
        return str(absolute.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(absolute)
