"""One exception tree: every public exception class treadle defines is a
`TreadleError` and is drawn in the tree of `treadle.errors`' docstring."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import treadle
from treadle import errors
from treadle.errors import TreadleError

# The trainer adapters that import their trainer (each in its own virtualenv: the
# tests in tests/trainers/ import them there).
TRAINER_MODULES = {"treadle.client.skyrl_generator", "treadle.client.verl_manager",
                   "treadle.client.verl_weights"}


def _exception_classes() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(treadle.__path__, "treadle."):
        if info.name.endswith("__main__"):
            continue  # running it is what importing it does
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError:
            # Only a trainer adapter may need a library (its trainer's, and what
            # that imports) this virtualenv lacks.
            if info.name not in TRAINER_MODULES:
                raise
            continue
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not name.startswith("_")):
                out[f"{module.__name__}.{name}"] = obj
    return out


def test_every_public_exception_is_a_treadle_error_named_in_the_tree() -> None:
    classes = _exception_classes()
    assert len(classes) > 30  # the walk found them
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, TreadleError))
    assert not outside, f"not TreadleErrors: {outside}"
    tree = errors.__doc__ or ""
    missing = sorted(name for name, cls in classes.items() if cls.__name__ not in tree)
    assert not missing, f"not drawn in treadle.errors: {missing}"
