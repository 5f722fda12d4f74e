"""jaxattn.io: the compilation cache (where it lives, how it is turned off, a lab run that fills it) and the scripts' argument types."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxattn import io as jio

ROOT = Path(__file__).resolve().parent.parent


def test_cache_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jio.compilation_cache_dir() == tmp_path / "xdg" / "jaxattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jio.compilation_cache_dir() == tmp_path / "home" / ".cache" / "jaxattn"


@pytest.mark.parametrize("value, disabled", [("1", True), ("yes", True), ("0", False), ("", False), ("false", False)])
def test_environment_variable_turns_the_cache_off(monkeypatch, tmp_path, value, disabled):
    monkeypatch.setenv(jio.NO_CACHE_VARIABLE, value)
    assert jio.compilation_cache_disabled() is disabled
    if disabled:  # (turning it on would change this process's JAX configuration: see the subprocess test)
        assert jio.use_compilation_cache(tmp_path / "cache") is None
        assert not (tmp_path / "cache").exists()
        assert jax.config.jax_compilation_cache_dir != str(tmp_path / "cache")


def test_cache_off_by_argument_and_bad_arguments(tmp_path):
    assert jio.use_compilation_cache(tmp_path / "cache", enabled=False) is None
    assert not (tmp_path / "cache").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"path: the compilation cache must be a folder, and '.*file' is a file"):
        jio.use_compilation_cache(tmp_path / "file")
    with pytest.raises(TypeError, match="enabled must be a bool, received str"):
        jio.use_compilation_cache(tmp_path / "cache", enabled="no")


def _lab_part1(tmp_path, *extra, env=None):
    environ = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu")
    environ.pop(jio.NO_CACHE_VARIABLE, None)
    environ.update(env or {})
    proc = subprocess.run([sys.executable, "experiments/lab.py", "--parts", "1", "--out", str(tmp_path / "out"), *extra],
                          capture_output=True, text=True, cwd=ROOT, env=environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _entries(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.slow  # three lab processes; tests/test_lab_saturation.py checks in-process that the lab asks for the cache
def test_a_second_lab_run_loads_every_program_and_prints_the_same(tmp_path):
    first = _lab_part1(tmp_path)
    folder = tmp_path / "xdg" / "jaxattn"
    assert f"compiled programs: kept in {folder} (--no-cache: not kept)" in first.stdout.splitlines()
    assert "part 1: attention on 4 tokens ... " in first.stderr  # progress on stderr, numbers on stdout
    kept = _entries(folder)
    assert len(kept) > 0
    second = _lab_part1(tmp_path)
    assert _entries(folder) == kept  # every program came from the cache: nothing new was written
    assert second.stdout == first.stdout
    off = _lab_part1(tmp_path / "off", env={jio.NO_CACHE_VARIABLE: "1"})
    assert "compiled programs: not kept" in off.stdout and not (tmp_path / "off" / "xdg").exists()


def test_the_scripts_argument_types_refuse_bad_text_with_argparses_usage_error():
    import argparse

    from jaxattn.io import int_at_least, mesh_arg

    assert int_at_least(0)("0") == 0 and int_at_least(2)("7") == 7
    assert mesh_arg("2x3") == (2, 3)
    for parse, text, says in [(int_at_least(1), "0", "must be a positive int, received '0'"),
                              (int_at_least(2, " (two keys)"), "x", "must be an int >= 2 (two keys), received 'x'"),
                              (mesh_arg, "abc", "must be DATAxMODEL, two positive ints such as 2x3, received 'abc'"),
                              (mesh_arg, "2x0", "must be DATAxMODEL")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            parse(text)
