"""The start of a program made of this package's modules, inside a sandbox.

Run as ``python3 -I -S -c <this file> N NAME SOURCE ... ARGS...`` with N pairs of a
module's name and its source (treadle's checkout is hidden inside, so the host
passes them). Each module is loaded as ``treadle.sandbox.inside.NAME``, in the order
given, so a module may import the ones before it as it does on the host (``from
treadle.sandbox.inside import procs``); then ARGS are ``sys.argv[1:]`` and the last
module's ``main()`` runs. Standard library only.
"""

from __future__ import annotations

import sys
import types

PACKAGE = "treadle.sandbox.inside"


def load(pairs: list[str]) -> types.ModuleType:
    """Load (name, source) pairs as modules of PACKAGE; the last one."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = []  # a package, whose modules are all loaded here
    sys.modules[PACKAGE] = package
    module = package
    for name, source in zip(pairs[::2], pairs[1::2], strict=True):
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__package__ = PACKAGE
        sys.modules[module.__name__] = module
        setattr(package, name, module)
        exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def main() -> None:
    end = 2 + 2 * int(sys.argv[1])
    program = load(sys.argv[2:end])
    del sys.argv[1:end]
    program.main()


if __name__ == "__main__":
    main()
