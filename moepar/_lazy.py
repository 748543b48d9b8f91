"""PEP 562 lazy attributes for moepar's packages.

A package lists each public name with the module that defines it; the module is imported on
the first access (``moepar.MoE``, ``from moepar import MoE``) and the value is then cached in
the package, so ``import moepar`` alone imports neither torch nor triton and a torch-free
part (``moepar.cost``, ``python -m moepar price``) stays torch-free.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable, Iterable, Mapping


def attach(package: str, names: Mapping[str, str], submodules: Iterable[str] | None = None
           ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    ``names`` maps a public name to ``".module"`` (relative to the package; the attribute has
    the same name) or ``".module:attr"`` (another name there). ``submodules``: the names
    imported as submodules on attribute access, as an eager ``__init__`` had left them set;
    None allows any submodule of the package (one that needs no optional extra)."""
    allowed = None if submodules is None else frozenset(submodules)

    def __getattr__(name: str) -> object:
        if name in names:
            module, _, attr = names[name].partition(":")
            value = getattr(importlib.import_module(module, package), attr or name)
        elif not name.startswith("_") and (name in allowed if allowed is not None
                                           else importlib.util.find_spec(f"{package}.{name}") is not None):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)   # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
