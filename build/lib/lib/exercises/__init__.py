"""Checks for the notebooks' exercises, in the manner of ARENA's ``tests.py``.

Every exercise asks for a function. ``check_<name>(student_fn)`` in ``lib.exercises.exNN`` (NN: the notebook's
number) calls the student's function and the reference solution ``<name>`` on small made-up inputs, compares
what they return (``torch.testing.assert_close``, numpy's and pandas' asserts) and prints "All tests passed".
The reference solutions live here, not in the notebooks' cells, so a student copy (``make student``) keeps
every check cell and none of the answers::

    from lib.exercises.ex00 import check_top_pushes
    check_top_pushes(top_pushes)
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd
import torch

PASSED = "All tests passed"


def assert_same(got: Any, want: Any, where: str = "result", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Assert that ``got`` equals ``want`` (the reference's result), recursing into tuples, lists, dicts and
    dataclasses; tensors with ``torch.testing.assert_close``, arrays with numpy's, frames and series with
    pandas', floats to ``rtol``/``atol`` (NaN equals NaN)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
        torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), rtol=rtol, atol=atol, check_dtype=False,
                                   equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, np.ndarray):
        got = np.asarray(got.detach().cpu() if isinstance(got, torch.Tensor) else got)
        assert got.shape == want.shape, f"{where}: shape {got.shape}, expected {want.shape}"
        if want.dtype.kind in "fc":
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=where)
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, pd.DataFrame):
        assert isinstance(got, pd.DataFrame), f"{where}: expected a DataFrame, got {type(got).__name__}"
        pd.testing.assert_frame_equal(got, want, check_dtype=False, check_exact=False, rtol=rtol, atol=atol,
                                      check_index_type=False, check_column_type=False, obj=where)
    elif isinstance(want, pd.Series):
        assert isinstance(got, pd.Series), f"{where}: expected a Series, got {type(got).__name__}"
        pd.testing.assert_series_equal(got, want, check_dtype=False, check_exact=False, rtol=rtol, atol=atol,
                                       check_index_type=False, check_names=False, obj=where)
    elif dataclasses.is_dataclass(want) and not isinstance(want, type):
        assert type(got) is type(want), f"{where}: expected a {type(want).__name__}, got {type(got).__name__}"
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}", rtol, atol)
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        assert list(got) == list(want), f"{where}: keys {list(got)}, expected {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]", rtol, atol)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)), f"{where}: expected a {type(want).__name__}, got {type(got).__name__}"
        assert len(got) == len(want), f"{where}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]", rtol, atol)
    elif want is None or isinstance(want, (str, bool, np.bool_)):
        assert got == want, f"{where}: {got!r}, expected {want!r}"
    elif isinstance(want, (int, np.integer)):
        assert isinstance(got, (int, np.integer)) and not isinstance(got, bool) and got == want, \
            f"{where}: {got!r}, expected {want!r}"
    elif isinstance(want, (float, np.floating)):
        got = float(got.item() if isinstance(got, (torch.Tensor, np.ndarray)) else got)
        if np.isnan(want):
            assert np.isnan(got), f"{where}: {got!r}, expected NaN"
        else:
            assert np.isclose(got, float(want), rtol=rtol, atol=atol), f"{where}: {got!r}, expected {float(want)!r}"
    else:
        assert got == want, f"{where}: {got!r}, expected {want!r}"


Case = tuple  # (args, kwargs) for one call


def run_cases(student_fn: Callable, reference: Callable, cases: Iterable[Case], rtol: float = 1e-5,
              atol: float = 1e-6) -> None:
    """Call ``student_fn`` and ``reference`` on each case (a copy of the inputs each, so neither sees what
    the other changed in place), assert that they agree, and print "All tests passed"."""
    name = getattr(reference, "__name__", "the function")
    for i, (args, kwargs) in enumerate(cases, 1):
        want = reference(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        got = student_fn(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        assert_same(got, want, f"{name}, test {i}", rtol, atol)
    print(PASSED)


def generator(seed: int = 0) -> torch.Generator:
    """A seeded CPU generator for the small inputs of a check."""
    return torch.Generator().manual_seed(seed)
