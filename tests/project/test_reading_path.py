"""What a newcomer reads stays what the docs say: the files one default forward runs are
exactly the reading list of docs/moe.md, the files the cost report runs exactly the one of
docs/cost.md (tests/helpers/reading_path.py traces them), and no code or test comment cites this
project's own issue numbers (the peers' issues are cited with their project's name)."""
import os
import re
import subprocess
import sys

import pytest

from ..helpers.multiproc import run_ranks
from ..helpers.reading_path import REPORT_ARGS, ROOT, default_forward_files, line_count

_PATH = re.compile(r"`((?:moepar|kernels)/[\w/]+\.py)`")


def _listed(page: str, heading: str) -> list[str]:
    """The backticked package paths of ``heading``'s section of docs/``page``."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        text = f.read()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return list(dict.fromkeys(_PATH.findall(text[start:end if end > 0 else None])))


def _check(traced: list[str], listed: list[str], page: str) -> None:
    missing, extra = sorted(set(traced) - set(listed)), sorted(set(listed) - set(traced))
    assert not missing and not extra, (
        f"docs/{page}'s reading list is out of date: it lacks {missing} (they run) and lists {extra} "
        f"(they do not run); traced: {traced}")
    print(f"{len(traced)} files, {sum(line_count(p) for p in traced)} lines")


# Fresh processes: a cache warmed by an earlier test (an lru_cache, a cached property)
# would hide the calls that fill it, and a newcomer reads those too.
def test_the_default_forward_runs_exactly_the_files_docs_moe_lists():
    traced = run_ranks(default_forward_files, 2, fresh=True)
    assert traced[0] == traced[1]
    _check(traced[0], _listed("moe.md", "## Reading order"), "moe.md")


def test_the_cost_report_runs_exactly_the_files_docs_cost_lists():
    out = subprocess.run([sys.executable, "-m", "tests.helpers.reading_path", "report", "--list", *REPORT_ARGS],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    _check(out.split(), _listed("cost.md", "## Reading order"), "cost.md")


# "<project> issue #N" / "<project> #N" name a peer's issue; a bare "issue N" is this project's.
_BARE_ISSUE = re.compile(r"(^|[\s(\[;,])([Ii]ssues? #?\d+)")
_PROJECT = re.compile(r"[A-Za-z][\w.-]*-?\w*$")
_NOT_A_PROJECT = {"the", "this", "that", "an", "a", "see", "in", "of", "for", "by", "and", "or", "our", "from"}


def _own_issue_citations(path: str) -> list[str]:
    found = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            for m in _BARE_ISSUE.finditer(line):
                before = line[:m.start(2)].rstrip()
                word = _PROJECT.search(before)
                if m.group(1) in ("(", "[", ";", ",") or word is None or word.group(0).lower() in _NOT_A_PROJECT:
                    found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    return found


@pytest.mark.parametrize("top", ["moepar", "kernels", "tests", "examples", "scripts"])
def test_no_code_comment_cites_this_projects_issue_numbers(top):
    bad = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
        bad += [c for name in files if name.endswith(".py")
                for c in _own_issue_citations(os.path.join(dirpath, name))]
    assert not bad, "issue numbers belong in the tracker, not the code:\n" + "\n".join(bad)


def test_the_issue_citation_rule_tells_a_peer_issue_from_our_own(tmp_path):
    own = ["# the layer (" + "issue 34) is not", "# nor is: see " + "issue 27"]   # split: this file is scanned too
    p = tmp_path / "x.py"
    p.write_text("# nccl-tests issue #212 and torchtitan #1593 are fine\n" + "\n".join(own) + "\n")
    assert [c.split(": ", 1)[1] for c in _own_issue_citations(str(p))] == own
