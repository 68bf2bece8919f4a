"""Package faces whose names load their module on first use (PEP 562).

A command package (``prewarm``, ``simulate``) re-exports names from modules
that import torch or FlashInfer; importing the package for ``--help`` or for
the sidecar's own commands must not. The package lists which module holds
each public name and gets a module ``__getattr__`` that imports it then, and
a module ``__dir__`` that lists those names before they are loaded (so
``dir(package)`` and a REPL's completion show them).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, names_by_module: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``names_by_module``
    (module, relative to ``package`` -> its public names) is imported from its
    module when first asked for. The package (being imported: it calls this)
    is also given a ``__dir__`` listing its names, loaded or not, and its
    ``__all__``.

    Raises:
        ValueError: a name is listed under two modules.
    """
    module_of: dict[str, str] = {}
    for module, names in names_by_module.items():
        for name in names:
            if name in module_of:
                raise ValueError(
                    f"{package}: {name!r} listed under both {module_of[name]!r} and {module!r}"
                )
            module_of[name] = module

    def __getattr__(name: str) -> Any:
        """The public ``name``, from its module (imported now if it was not yet).

        Raises:
            AttributeError: not a public name of this package.
        """
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    face = sys.modules[package]

    def __dir__() -> list[str]:
        """The package's names: what it holds, its lazy names and ``__all__``."""
        return sorted({*vars(face), *module_of, *getattr(face, "__all__", ())})

    face.__dir__ = __dir__  # type: ignore[method-assign]  # PEP 562: the module's dir()
    return __getattr__
