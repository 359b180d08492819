"""The public functions generated from ops.pointwise.TABLE: engine.<name>, engine.functional's
and Tensor's, one per parameter-free entry with a doc. A new entry adds its reference here."""
import inspect

import numpy as np
import pytest

import engine
from engine import functional
from ops.pointwise import TABLE

REFERENCES = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "relu": lambda a: np.maximum(a, 0), "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "tanh": np.tanh, "abs": np.abs,
}


def test_every_entry_with_a_doc_is_generated_and_has_a_reference():
    documented = {entry.name for entry in TABLE if entry.doc}
    assert set(functional.POINTWISE) == documented == set(REFERENCES)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_the_generated_function_method_and_engine_name(name):
    values = np.array([-2.5, -0.5, 0.25, 1.0, 3.0])
    x = engine.tensor(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        expected = REFERENCES[name](values)
    function = getattr(engine, name)
    assert function is getattr(functional, name) is getattr(engine.Tensor, name)
    for result in (function(x), getattr(x, name)()):
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-12, equal_nan=True)
    assert str(inspect.signature(function)) == "(x)"
    assert function.__name__ == name and "elementwise" in function.__doc__


def test_engine_finds_a_generated_name_it_does_not_list(monkeypatch):
    """A new entry needs no line in engine/__init__.py: a name the lazy table lacks is looked
    up among the generated functions."""
    monkeypatch.delitem(engine._LAZY_SOURCE, "tanh")
    monkeypatch.delitem(vars(engine), "tanh", raising=False)
    assert engine.tanh is functional.POINTWISE["tanh"]
    assert "tanh" in dir(engine)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function'"):
        engine.no_such_function
