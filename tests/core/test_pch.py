"""The precompiled torch header (kernelpilot/pch.py): made once and shared, used by g++ in a real build, and left
out, with the build going on as before, wherever it cannot or must not be used."""

from __future__ import annotations

import fcntl
import shlex
import subprocess
from pathlib import Path

import pytest

from kernelpilot import pch

CPP = [Path("kernels/binding.cpp")]


@pytest.fixture
def gcc() -> str:
    if not pch._is_gcc("c++"):
        pytest.skip("c++ is not g++ here: kernelpilot precompiles headers only for g++")
    return "c++"


@pytest.mark.cuda_build
def test_a_build_includes_the_shared_header_and_gcc_reads_its_precompiled_form(built, gcc):
    root, result = built  # the build tests' workspace (conftest.py): a .cu and a C++ binding, built once
    assert result.ok, result.log

    ninja = (root / "build" / "build.ninja").read_text()
    flags_line = next(line for line in ninja.splitlines() if line.startswith("cxx_flags = "))
    flags = shlex.split(flags_line.removeprefix("cxx_flags = "))
    header = Path(flags[flags.index("-include") + 1])
    assert header.parent.parent == pch.pch_root() and header.with_suffix(".h.gch").is_file()
    # g++ -H marks a precompiled header it used with "!" (and one it could not use with "x").
    shown = subprocess.run(
        [gcc, *flags, "-H", "-Winvalid-pch", "-fsyntax-only", str(root / "kernels" / "scale_binding.cpp")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"! {header}.gch" in shown.stderr.splitlines()[0], shown.stderr[:500]


def test_no_header_when_turned_off_without_a_cpp_source_or_with_unconfined_sandboxes(tmp_path, monkeypatch):
    monkeypatch.setenv(pch.DIR_ENV, str(tmp_path / "pch"))
    monkeypatch.setattr(pch, "precompiled_header", lambda cxx, flags: tmp_path / "pch" / "made" / pch.HEADER_NAME)
    assert pch.include_flags("c++", [], CPP) == ["-include", str(tmp_path / "pch" / "made" / pch.HEADER_NAME)]
    assert pch.include_flags("c++", [], [Path("kernels/only.cu")]) == []
    monkeypatch.undo()

    monkeypatch.setenv(pch.DIR_ENV, str(tmp_path / "pch"))
    monkeypatch.setenv(pch.ENABLE_ENV, "0")
    assert pch.include_flags("c++", [], CPP) == []
    monkeypatch.delenv(pch.ENABLE_ENV)
    monkeypatch.setattr(pch, "_sandboxes_confined", lambda: False)
    assert pch.include_flags("c++", [], CPP) == []
    assert not (tmp_path / "pch").exists(), "nothing is made where no header is used"


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(pch.DIR_ENV, str(tmp_path / "mine"))
    assert pch.pch_root() == tmp_path / "mine"
    monkeypatch.delenv(pch.DIR_ENV)
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(tmp_path / "cache"))
    assert pch.pch_root() == tmp_path / "cache" / "pch"


@pytest.mark.slow
def test_a_failed_compile_is_kept_and_not_tried_again(tmp_path, monkeypatch, gcc):
    monkeypatch.setenv(pch.DIR_ENV, str(tmp_path / "pch"))
    flags = ["-DKP_TEST", "-I/nonexistent", "-include", "no_such_header_anywhere.h"]
    assert pch.precompiled_header(gcc, flags) is None
    [failed] = (tmp_path / "pch").glob(f"*/{pch.FAILED_NAME}")
    assert "no_such_header_anywhere.h" in failed.read_text()
    assert not list((tmp_path / "pch").glob("*/*.gch")) and not list((tmp_path / "pch").glob("*/.*.gch"))

    def compiles(*args, **kwargs):
        raise AssertionError("compiled again after a kept failure")

    monkeypatch.setattr(pch, "_compile", compiles)
    assert pch.precompiled_header(gcc, flags) is None


@pytest.mark.slow
def test_a_build_that_waits_too_long_for_another_maker_goes_on_without_the_header(tmp_path, monkeypatch, gcc):
    monkeypatch.setenv(pch.DIR_ENV, str(tmp_path / "pch"))
    monkeypatch.setattr(pch, "WAIT_S", 0.5)
    flags = ["-DKP_WAIT_TEST"]
    folder = tmp_path / "pch" / pch._key(gcc, flags)
    folder.mkdir(parents=True)
    with (folder / ".lock").open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another process making the same header
        assert pch.precompiled_header(gcc, flags) is None
    assert not (folder / f"{pch.HEADER_NAME}.gch").exists()
