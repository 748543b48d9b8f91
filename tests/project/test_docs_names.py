"""Every ``moepar.<name>`` the docs and the README call exists (docs/fsdp.md once
called ``moepar.grad_norm``, which was not a public name then)."""
import glob
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
NAME = re.compile(r"\bmoepar(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _names():
    found = set()
    for page in PAGES:
        with open(page) as f:
            for name in NAME.findall(f.read()):
                if name.endswith(("_py", ".py", ".md")):
                    continue
                found.add((os.path.relpath(page, ROOT), name))
    return sorted(found)


def test_the_pages_name_something():
    assert len(_names()) > 30


@pytest.mark.parametrize("page,name", _names())
def test_every_documented_moepar_name_exists(page, name):
    try:
        _resolve(name)
    except (AttributeError, ModuleNotFoundError) as e:
        pytest.fail(f"{page} names {name}, which does not exist ({e})")
