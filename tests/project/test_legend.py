"""One legend of shape letters (docs/moe.md, "Legend") for moepar/ and kernels/.

Three checks, each a place a letter could drift from the table: the shape suffixes of names
(``x_TD``), bracketed shapes in the code's text (``[T, K]``), and the "Legend:" paragraphs of
module docstrings, where each letter must be introduced with words of its table meaning
(``P EP ranks`` passes, ``P programs of the launch`` fails).
"""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Words that introduce each table letter in a module's legend (lower case, any of them).
MEANING = {
    "T": ("token",), "D": ("hidden",), "F": ("ffn", "expert", "hidden"), "Fl": ("etp", "slice", "local"),
    "Fs": ("shared",), "E": ("expert",), "L": ("local", "e/"), "K": ("top-k", "route", "top"),
    "R": ("route", "rows"), "N": ("row", "route", "t*k"), "M": ("row", "receive"), "P": ("ep",),
    "S": ("source", "etp"), "B": ("block", "rank", "sequence"), "W": ("column",), "C": ("slot", "capacity"),
    "G": ("group",), "X": ("redundant",), "H": ("slot",), "A": ("cop",), "Q": ("scale",), "V": ("byte",),
}


def _table_letters() -> set[str]:
    doc = open(os.path.join(ROOT, "docs", "moe.md")).read()
    section = doc[doc.index("## Legend"):doc.index("## Reading order")]
    letters = set(re.findall(r"^\| ([A-Za-z]) \|", section, re.M))
    letters |= set(re.findall(r"`(F[a-z])[ `]", section))          # Fl, Fs in F's row
    return letters


LETTERS = _table_letters()


def _sources() -> list[str]:
    out = []
    for top in ("moepar", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_the_table_holds_every_letter_the_meanings_know():
    assert set(MEANING) <= LETTERS, sorted(set(MEANING) - LETTERS)


_SUFFIX = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*_((?:[A-Z][a-z]?|1)+)$")


def _names(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.arg):
            yield n.arg
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield n.name


def test_shape_suffixes_use_table_letters():
    odd = {}
    for path in _sources():
        for name in _names(ast.parse(open(path).read())):
            m = _SUFFIX.match(name)
            if m:
                bad = [t for t in re.findall(r"[A-Z][a-z]?|1", m.group(1)) if t != "1" and t not in LETTERS]
                if bad:
                    odd.setdefault(_rel(path), set()).add(name)
    assert not odd, f"shape suffixes with letters docs/moe.md's legend lacks: {odd}"


_BRACKET = re.compile(r"\[((?:[A-Z][a-z]?|\d+)(?:, ?(?:[A-Z][a-z]?|\d+))+)\]")


def test_bracketed_shapes_use_table_letters():
    odd = []
    for path in _sources():
        for i, line in enumerate(open(path), 1):
            for m in _BRACKET.finditer(line):
                bad = [t.strip() for t in m.group(1).split(",") if not t.strip().isdigit()
                       and t.strip() not in LETTERS]
                if bad:
                    odd.append(f"{_rel(path)}:{i} {m.group(0)}")
    assert not odd, f"shapes with letters docs/moe.md's legend lacks: {odd}"


_LEGEND = re.compile(r"Legend[^\n:]*:(.*?)(?:\n\s*\n|\"\"\")", re.S)
_ENTRY = re.compile(r"(?:^|[,:;]\s+|\(|\s)([A-Z][a-z]?)(?=\s*=|\s+[a-z(])")


def _entries(body: str) -> list[tuple[str, str]]:
    """(letter, the words after it) where a legend's text first names each letter (later
    mentions use it: "a token whose K routes go to fewer than K ranks")."""
    first: dict[str, str] = {}
    for e in _ENTRY.finditer(body):
        first.setdefault(e.group(1), " ".join(body[e.end():e.end() + 48].lower().split()))
    return list(first.items())


def _legends() -> dict[str, list[tuple[str, str]]]:
    """{module: the (letter, words) its "Legend:" paragraphs introduce}, modules with one."""
    out: dict[str, list[tuple[str, str]]] = {}
    for path in _sources():
        with open(path) as f:
            for m in _LEGEND.finditer(f.read()):
                out.setdefault(_rel(path), []).extend(_entries(m.group(1)))
    return out


LEGENDS = _legends()


@pytest.mark.parametrize("path", sorted(LEGENDS))
def test_module_legends_say_what_the_table_says(path):
    wrong = []
    for letter, words in LEGENDS[path]:
        if letter not in LETTERS:
            wrong.append(f"{letter} (not in the table): {words!r}")
        elif letter in MEANING and not any(w in words for w in MEANING[letter]):
            wrong.append(f"{letter}: {words!r} (the table: {'/'.join(MEANING[letter])})")
    assert not wrong, f"{path}'s legend: {wrong}"


def test_a_legend_that_drifts_is_caught():
    # The check above on a made-up legend: P used for a kernel's programs fails it.
    entries = _entries(_LEGEND.search('"""Legend: T tokens, P programs of the launch."""').group(1))
    assert entries == [("T", "tokens, p programs of the launch."), ("P", "programs of the launch.")]
    assert any(w in entries[0][1] for w in MEANING["T"])
    assert not any(w in entries[1][1] for w in MEANING["P"])
