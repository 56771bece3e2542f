"""Property tests of `forge_ckpt.serialization`: random trees of every supported kind round-trip
exactly, from a file and from memory."""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from forge_ckpt.serialization import load, loads, snapshot

sys.path.insert(0, os.path.dirname(__file__))
from serialization_util import NP_DTYPES, TORCH_DTYPES, random_bits, same  # noqa: E402

# ---------------------------------------------------------------- property tests

_keys = st.one_of(
    st.text(max_size=5),
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.tuples(st.integers(-5, 5), st.text(max_size=3)),
)
_np_arrays = hnp.arrays(
    dtype=st.sampled_from([np.dtype(d) for d in NP_DTYPES]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
)
_tensors = st.builds(
    lambda shape, dtype, seed: random_bits(shape, dtype, seed),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    st.sampled_from(TORCH_DTYPES),
    st.integers(0, 1000),
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(),
    st.text(),
    st.binary(),
    _np_arrays,
    _tensors,
    hnp.from_dtype(np.dtype(np.float32)).map(np.float32),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.booleans().map(np.bool_),
)
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(_keys, kids, max_size=4),
    ),
    max_leaves=20,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tree=_trees)
def test_property_random_trees_roundtrip(tmp_path, tree):
    path = str(tmp_path / "p.bin")
    rec = snapshot(tree, name="p", copy=True).write(path, "p.bin")
    assert same(load(path, rec), tree)


@settings(max_examples=100, deadline=None)
@given(tree=_trees)
def test_property_loads_from_memory(tree):
    snap = snapshot(tree, name="p")
    assert snap.nbytes >= 16
    image = _image(snap)
    assert len(image) == snap.nbytes
    assert same(loads(image), tree)


def _image(snap) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        snap.write(os.path.join(d, "f"), "f")
        with open(os.path.join(d, "f"), "rb") as f:
            return f.read()
