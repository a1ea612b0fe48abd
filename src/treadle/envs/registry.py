"""Suites by name: `get_suite("math")`, `register_suite("mine", MySuite)`.

Built-in names: math, code, swe, search, stem, swe-images (no arguments needed;
``swe-images`` takes ``instances=`` a JSONL of SWE-bench-style instances), and the
adapters nemo_gym (needs ``base_url=``) and gym_text (needs a ``make_env``
callable). Options are passed to the suite's constructor: ``get_suite("search",
python_tool=False)``. Suite modules are imported on first use, so importing the
registry stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from treadle.envs.base import Suite
from treadle.envs.errors import EnvConfigError

SuiteFactory = Callable[..., Suite]

_BUILTIN = {
    "math": "treadle.envs.suites.math:MathSuite",
    "code": "treadle.envs.suites.code:CodeSuite",
    "swe": "treadle.envs.suites.swe:SweSuite",
    "swe-images": "treadle.envs.suites.swe_images:SweImageSuite",
    "search": "treadle.envs.suites.search:SearchSuite",
    "stem": "treadle.envs.suites.stem:StemSuite",
    "nemo_gym": "treadle.envs.adapters.nemo_gym:NemoGymSuite",
    "gym_text": "treadle.envs.adapters.gym_text:GymTextSuite",
}
_registered: dict[str, SuiteFactory] = {}


def register_suite(name: str, factory: SuiteFactory, *, replace: bool = False) -> None:
    """Make `get_suite(name, **options)` call `factory(**options)`.

    A name already taken (built in or registered) is refused unless `replace`.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"suite names are letters, digits, '-' and '_'; got {name!r}")
    if not replace and (name in _registered or name in _BUILTIN):
        raise EnvConfigError(f"a suite named {name!r} already exists; pass replace=True")
    _registered[name] = factory


def unregister_suite(name: str) -> None:
    """Forget a registered suite (built-ins cannot be removed)."""
    _registered.pop(name, None)


def suite_names() -> list[str]:
    """Every name `get_suite` accepts, sorted."""
    return sorted(set(_BUILTIN) | set(_registered))


def _factory(name: str) -> SuiteFactory:
    factory = _registered.get(name)
    if factory is None:
        target = _BUILTIN.get(name)
        if target is None:
            raise EnvConfigError(f"unknown suite {name!r}; choose one of "
                                 f"{', '.join(suite_names())}")
        module, _, attribute = target.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory


def file_options(name: str) -> tuple[str, ...]:
    """The options of suite `name` that name host files (`Suite.file_options`; a
    registered factory may declare them as its own `file_options` attribute)."""
    return tuple(getattr(_factory(name), "file_options", ()))


def get_suite(name: str, **options: Any) -> Suite:
    """A new suite instance; EnvConfigError for an unknown name or bad options."""
    factory = _factory(name)
    try:
        return factory(**options)
    except TypeError as e:
        raise EnvConfigError(f"suite {name!r}: {e}") from e
