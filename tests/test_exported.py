"""The saturation sweep kept as a ``jax.export`` artifact (jaxattn._exported, internals on purpose): the same
numbers bit for bit, read back without tracing, keyed by what the program depends on, a damaged file made again."""

import jax
import numpy as np
import pytest

from jaxattn import _exported, probes

SMALL = dict(head_dims=(8,), num_trials=2, num_queries=3, num_keys=4, value_dim=2)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    assert _exported.can_serialize(), "jax.export's serialization needs flatbuffers (jaxattn[lab])"
    monkeypatch.setattr(_exported, "_LOADED", {})  # as a fresh process would start
    _exported.keep_in(tmp_path / "exported")
    yield tmp_path / "exported"
    _exported.keep_in(None)


def _same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name


def _no_export(*args, **kwargs):
    raise AssertionError("traced and exported again instead of read from its file")


def test_a_kept_sweep_gives_the_same_numbers_and_is_read_back_without_tracing(kept, monkeypatch):
    plain = probes.saturation_sweep(0, **SMALL)  # the jitted program (keep_in set, but nothing kept yet)
    first = probes.saturation_sweep(1, **SMALL)
    files = sorted(kept.iterdir())
    assert len(files) == 1 and files[0].name.startswith("saturation_sweep-") and files[0].suffix == ".jaxexport"
    _exported.keep_in(None)
    _same(probes.saturation_sweep(1, **SMALL), first)  # exported and jitted: bit for bit
    _exported.keep_in(kept)
    monkeypatch.setattr(_exported, "_LOADED", {})
    monkeypatch.setattr(jax.export, "export", _no_export)
    _same(probes.saturation_sweep(1, **SMALL), first)  # read from the file alone
    _same(probes.saturation_sweep(0, **SMALL), plain)  # other keys: the same program
    assert sorted(kept.iterdir()) == files


@pytest.mark.slow  # make test-slow (make test's time)
def test_what_the_program_depends_on_names_its_file(kept):
    probes.saturation_sweep(0, **SMALL)
    probes.saturation_sweep(0, **SMALL, logit_cap=2.0)  # a capped program: another file
    probes.saturation_sweep(0, **SMALL, logit_cap=3.0)  # the cap is data: the same program
    probes.saturation_sweep(0, **SMALL, remedies=["none", ("cap", 2.0)])
    names = sorted(p.name.split("-")[0] for p in kept.iterdir())
    assert names == ["remedy_sweep"] + ["saturation_sweep"] * 2
    a = _exported._key("p", (np.zeros(3, np.float32),), {"T": 2})
    assert a == _exported._key("p", (np.ones(3, np.float32),), {"T": 2})  # values are not part of it
    assert len({a, _exported._key("p", (np.zeros(3, np.float16),), {"T": 2}),
                _exported._key("p", (np.zeros(4, np.float32),), {"T": 2}),
                _exported._key("p", (np.zeros(3, np.float32),), {"T": 3}),
                _exported._key("q", (np.zeros(3, np.float32),), {"T": 2})}) == 5


def test_a_damaged_file_is_said_and_made_again(kept, monkeypatch):
    first = probes.saturation_sweep(0, **SMALL)
    (path,) = kept.iterdir()
    path.write_bytes(b"not a program")
    monkeypatch.setattr(_exported, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match=r"could not read the exported program '.*saturation_sweep-.*'; *|exporting it again"):
        again = probes.saturation_sweep(0, **SMALL)
    _same(again, first)
    assert path.read_bytes() != b"not a program"


def test_without_a_folder_nothing_is_written(tmp_path, monkeypatch):
    _exported.keep_in(None)
    monkeypatch.setattr(jax.export, "export", _no_export)
    probes.saturation_sweep(0, **SMALL)
    assert _exported.folder() is None
