"""Bash's write guard: where a command line would write or `cd`, checked against the workspace before it runs.

It reads the command statically (shlex tokens, redirections, the writing programs it knows, nested shells,
find/xargs), so it is a guard rail for an honest model that slips, not a sandbox: a program can still write
anywhere it likes. Refusals are RecoverableErrors, whose message the model reads and can act on.
"""

from __future__ import annotations

import glob
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from kernelpilot.agent import RecoverableError

BOOKKEEPING_DIR = ".kernelpilot"  # kernelpilot's folder in the workspace: the manifest, pristine copies, sessions
SCRATCH_DIR = ".kernelpilot/tmp"  # HOME and TMPDIR of Bash commands, the one part of it commands may write

_OPERATOR_CHARS = "();<>|&\n"
_HEREDOC = re.compile(r"<<(-?)[ \t]*(['\"]?)\\?([A-Za-z0-9_.-]+)\2")
_KNOWN_VARIABLES = re.compile(r"\$(?:\{(HOME|TMPDIR)\}|(HOME|TMPDIR)(?![A-Za-z0-9_]))")
_SAFE_TARGETS = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/fd/1", "/dev/fd/2"})
_WRAPPERS = frozenset({"command", "builtin", "exec", "nohup", "time", "env", "nice", "timeout", "stdbuf"})
_WRAPPER_ARGUMENT = re.compile(r"-.*|[A-Za-z_][A-Za-z0-9_]*=.*|\d+(\.\d+)?[smhd]?")
_SHELLS = frozenset({"bash", "sh", "dash", "zsh"})
# program -> options that take a value (so the value is not mistaken for a path operand)
_OPTION_VALUES = {
    "cp": {"-t", "--target-directory", "-S", "--suffix"},
    "mv": {"-t", "--target-directory", "-S", "--suffix"},
    "ln": {"-t", "--target-directory", "-S", "--suffix"},
    "install": {"-t", "--target-directory", "-m", "--mode", "-o", "--owner", "-g", "--group", "-S", "--suffix"},
    "mkdir": {"-m", "--mode"},
    "touch": {"-d", "--date", "-r", "--reference", "-t"},
    "truncate": {"-s", "--size", "-r", "--reference"},
    "shred": {"-n", "--iterations", "-s", "--size"},
    "chmod": {"--reference"},
    "chown": {"--reference"},
    "chgrp": {"--reference"},
    "sed": {"-e", "--expression", "-f", "--file", "-l", "--line-length"},
}
_EVERY_OPERAND_WRITTEN = frozenset({"tee", "touch", "mkdir", "chmod", "chown", "chgrp", "truncate"})
_EVERY_OPERAND_REMOVED = frozenset({"rm", "rmdir", "unlink", "shred"})
_DESTINATION_WRITTEN = frozenset({"cp", "ln", "install"})
_WRITERS = _EVERY_OPERAND_WRITTEN | _EVERY_OPERAND_REMOVED | _DESTINATION_WRITTEN | {"mv", "dd", "sed"}


class WriteGuard:
    """Statically find where a command line writes (redirections, tee, cp, mv, rm, touch, mkdir, chmod, ln, dd,
    sed -i, find -delete/-exec, nested `bash -c`) and where it cds, and refuse anything outside the workspace.

    Conservative where it cannot know: a relative path is checked against every folder the command may have cd'd
    to, a glob against its matches, and a write target built from a variable (other than $HOME/$TMPDIR) or from
    xargs is refused. It reads the command; it cannot see what programs do (python -c, make, ...).
    """

    def __init__(self, root: Path, home: Path):
        self.root, self.home = root, home
        self.working_dirs = {root}

    def check(self, command: str) -> None:
        """RecoverableError naming the first path that would be written or entered outside the workspace."""
        for words, redirect_targets in _simple_commands(_shell_tokens(command)):
            for target in redirect_targets:
                self._require_inside(target, f"output redirection `> {target}`")
            self._check_words(words)

    def _check_words(self, words: list[str]) -> None:
        words = _without_wrappers(words)
        if not words:
            return
        program, args = Path(words[0]).name, words[1:]
        if program in ("cd", "pushd"):
            self._change_directory(args)
        elif program in _SHELLS and _shell_command_string(args) is not None:
            self.check(_shell_command_string(args))
        elif program == "eval":
            self.check(" ".join(args))
        elif program == "find":
            self._check_find(args)
        elif program == "xargs":
            self._check_xargs(args)
        else:
            for target, removes in write_targets(program, args):
                self._require_inside(target, f"`{program}` target {target}", removes=removes)

    def _change_directory(self, args: list[str]) -> None:
        operands = [arg for arg in args if not arg.startswith("-")]
        if not operands:
            self.working_dirs.add(self.home)
            return
        self.working_dirs |= set(self._require_inside(operands[0], f"`cd {operands[0]}`", entering=True))

    def _check_find(self, args: list[str]) -> None:
        options_done = [arg for arg in args if arg not in ("-H", "-L", "-P")]
        starts = []
        for arg in options_done:
            if arg.startswith(("-", "(", "!")):
                break
            starts.append(arg)
        if "-delete" in args:  # deletes what it finds below its starting points, never a start outside them
            for start in starts or ["."]:
                self._require_inside(start, f"`find {start} -delete`")
        for index, arg in enumerate(args):
            if arg in ("-exec", "-execdir", "-ok", "-okdir"):
                nested = []
                for word in args[index + 1 :]:
                    if word in (";", "+"):
                        break
                    nested.append(word)
                self._check_words(nested)

    def _check_xargs(self, args: list[str]) -> None:
        rest = [arg for arg in args if not arg.startswith("-")]
        if rest and Path(rest[0]).name in _WRITERS:
            raise RecoverableError(
                f"Refused before running: `xargs {rest[0]}` writes to paths read from its input, which cannot be "
                "checked beforehand; name the paths in the command (inside the workspace) instead."
            )

    def _require_inside(self, raw: str, what: str, *, removes: bool = False, entering: bool = False) -> list[Path]:
        """Every place `raw` may resolve to; RecoverableError when one is outside the workspace (or forbidden)."""
        resolved_paths = []
        for path in self._possible_paths(raw, what):
            resolved = path.resolve()
            if str(path) in _SAFE_TARGETS or str(resolved) in _SAFE_TARGETS:
                continue
            if not resolved.is_relative_to(self.root):
                after_cd = " (after a cd, relative paths are checked from every folder the command may be in)"
                raise RecoverableError(
                    f"Refused before running: {what} resolves to {resolved}, outside the workspace {self.root}. "
                    "Bash may only change files inside the workspace; use paths relative to its root"
                    f"{after_cd if len(self.working_dirs) > 1 else ''}."
                )
            if removes and resolved == self.root:
                raise RecoverableError(f"Refused before running: {what} would remove the workspace itself.")
            bookkeeping = self.root / BOOKKEEPING_DIR
            if not entering and resolved.is_relative_to(bookkeeping) and not resolved.is_relative_to(self.home):
                raise RecoverableError(
                    f"Refused before running: {what} touches {BOOKKEEPING_DIR}/, kernelpilot's manifest and pristine "
                    f"copies; use {SCRATCH_DIR}/ for scratch files."
                )
            resolved_paths.append(resolved)
        return resolved_paths

    def _possible_paths(self, raw: str, what: str) -> Iterator[Path]:
        """`raw` against each folder the command may be in, after ~, $HOME/$TMPDIR, brace and glob expansion."""
        text = _KNOWN_VARIABLES.sub(lambda _: str(self.home), raw)
        if text == "~" or text.startswith("~/"):
            text = str(self.home) + text[1:]
        elif text.startswith("~"):
            raise RecoverableError(f"Refused before running: {what} is in another user's home, outside the workspace.")
        if "$" in text or "`" in text:
            raise RecoverableError(
                f"Refused before running: where {what} points depends on a variable or a command substitution, "
                "which cannot be checked beforehand; write the path literally, relative to the workspace."
            )
        for alternative in _brace_alternatives(text):
            for working_dir in sorted(self.working_dirs):
                path = working_dir / alternative
                yield path
                if any(char in alternative for char in "*?["):
                    yield from (working_dir / match for match in glob.glob(alternative, root_dir=working_dir))


def _shell_command_string(args: list[str]) -> str | None:
    """The command string of `bash -c STRING` (or `-lc`, `-ec`, ...), None when the shell runs no -c string."""
    for index, arg in enumerate(args):
        if re.fullmatch(r"-[A-Za-z]*c[A-Za-z]*", arg):
            return next((word for word in args[index + 1 :] if not word.startswith("-")), None)
        if not arg.startswith("-"):
            return None
    return None


def write_targets(program: str, args: list[str]) -> list[tuple[str, bool]]:
    """The paths a (non-navigating) command writes, each with whether it is removed; [] for programs not known."""
    operands, options = _split_options(args, _OPTION_VALUES.get(program, set()))
    if program in _EVERY_OPERAND_WRITTEN:
        return [(operand, False) for operand in operands]
    if program in _EVERY_OPERAND_REMOVED:
        return [(operand, True) for operand in operands]
    target_dir = options.get("-t") or options.get("--target-directory")
    if program in _DESTINATION_WRITTEN:
        if target_dir:
            return [(target_dir, False)]
        return [(operands[-1], False)] if len(operands) >= 2 else []
    if program == "mv":  # the sources leave their folders, so they count as removed
        if target_dir:
            return [(source, True) for source in operands] + [(target_dir, False)]
        return [(source, True) for source in operands[:-1]] + [(destination, False) for destination in operands[-1:]]
    if program == "dd":
        return [(arg[3:], False) for arg in args if arg.startswith("of=")]
    if program == "sed" and _sed_in_place(args):
        script_given = any(name in options for name in ("-e", "--expression", "-f", "--file"))
        return [(operand, False) for operand in (operands if script_given else operands[1:])]
    return []


def _split_options(args: list[str], with_value: set[str]) -> tuple[list[str], dict[str, str]]:
    """(operands, {option: value}) of a command's arguments; `--` ends the options."""
    operands, options = [], {}
    words = iter(args)
    for word in words:
        if word == "--":
            operands += list(words)
        elif word.startswith("--") and "=" in word:
            name, value = word.split("=", 1)
            options[name] = value
        elif word in with_value:
            options[word] = next(words, "")
        elif word[:2] in with_value and not word.startswith("--"):
            options[word[:2]] = word[2:]
        elif word.startswith("-") and word != "-":
            options[word] = ""
        else:
            operands.append(word)
    return operands, options


def _sed_in_place(args: list[str]) -> bool:
    return any(
        arg.startswith("--in-place") or (arg.startswith("-") and not arg.startswith("--") and "i" in arg[1:])
        for arg in args
    )


def _without_wrappers(words: list[str]) -> list[str]:
    """The command words after variable assignments and wrappers such as `env`, `timeout 10` or `nohup`."""
    index = 0
    while index < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[index]):
        index += 1
    while index < len(words) and Path(words[index]).name in _WRAPPERS:
        index += 1
        while index < len(words) and _WRAPPER_ARGUMENT.fullmatch(words[index]):
            index += 1
    return words[index:]


def _brace_alternatives(text: str) -> list[str]:
    """Bash's brace expansion of `text` ("a/{b,c}" -> ["a/b", "a/c"])."""
    found = re.search(r"\{([^{}]*,[^{}]*)\}", text)
    if found is None:
        return [text]
    return [
        expanded
        for choice in found.group(1).split(",")
        for expanded in _brace_alternatives(text[: found.start()] + choice + text[found.end() :])
    ]


def _shell_tokens(command: str) -> list[str]:
    """Words and operators of a command line, quotes removed (shlex), comments and here-document bodies dropped."""
    lexer = shlex.shlex(_without_comments_and_heredocs(command), posix=True, punctuation_chars=_OPERATOR_CHARS)
    lexer.whitespace = " \t\r"  # newlines separate commands, so they stay tokens
    lexer.whitespace_split = True
    lexer.commenters = ""  # shlex would also cut `a#b`; comments are dropped above, where quoting is known
    try:
        return list(lexer)
    except ValueError as err:
        raise RecoverableError(f"Bash could not parse the command ({err}); check its quotes.") from None


def _without_comments_and_heredocs(command: str) -> str:
    """`command` without `# comments` and here-document bodies (text, not commands, and often with stray quotes)."""
    kept, pending, quote, index = [], [], None, 0
    while index < len(command):
        char = command[index]
        if quote == "'" or (quote == '"' and char not in '"\\'):
            quote = None if char == quote else quote
            kept.append(char)
        elif char == "\\":
            kept.append(command[index : index + 2])
            index += 1
        elif char in "'\"":
            quote = None if quote == char else char
            kept.append(char)
        elif char == "#" and (index == 0 or command[index - 1] in " \t\n;&|()"):
            end = command.find("\n", index)
            index = len(command) if end < 0 else end
            continue
        elif command.startswith("<<<", index):  # a here-string: its word is an ordinary word
            kept.append("<<<")
            index += 3
            continue
        elif heredoc := _HEREDOC.match(command, index):
            pending.append((heredoc.group(3), heredoc.group(1) == "-"))
            kept.append(heredoc.group(0))
            index = heredoc.end()
            continue
        elif char == "\n" and pending:
            kept.append("\n")
            index = _after_heredoc_bodies(command, index + 1, pending)
            pending = []
            continue
        else:
            kept.append(char)
        index += 1
    return "".join(kept)


def _after_heredoc_bodies(command: str, index: int, delimiters: list[tuple[str, bool]]) -> int:
    """The index just past the bodies of the pending here-documents, which start at `index`."""
    for delimiter, strip_tabs in delimiters:
        while index < len(command):
            end = command.find("\n", index)
            end = len(command) if end < 0 else end
            line = command[index:end]
            index = end + 1
            if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                break
    return min(index, len(command))


def _simple_commands(tokens: list[str]) -> Iterator[tuple[list[str], list[str]]]:
    """(words, output-redirection targets) of each simple command between operators."""
    words: list[str] = []
    targets: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        is_operator = all(char in _OPERATOR_CHARS for char in token)
        if is_operator and "(" not in token and ("<" in token or ">" in token):
            target = tokens[index + 1] if index + 1 < len(tokens) else ""
            if words and words[-1].isdigit():  # `2>`: the digit is the descriptor, not an argument
                words.pop()
            duplicates_descriptor = token.endswith("&") and (target.isdigit() or target == "-")
            if ">" in token and target and not duplicates_descriptor:
                targets.append(target)
            index += 2
            continue
        if is_operator:
            yield words, targets
            words, targets = [], []
        else:
            words.append(token)
        index += 1
    yield words, targets
