"""Every exercise of every chapter has its solution.

CONTRIBUTING.md ("The skeleton", point 7): a chapter ends with `## Exercises`, 2 to 5 of
them, each a paragraph that opens with its bold number (`**1. Title.** ...`) and is
followed, before the next exercise, by one hidden solution cell: tagged `hide-cell` and
labelled "Show solution" (tests/test_book_style.py checks the label's form).  The reader who
tries an exercise can always look up the answer; `fucina course solution` shows the
chapter's saved code, not these.

Only a chapter's own `## Exercises` section counts: it runs to the next `## ` heading.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

CHAPTERS = Path(__file__).resolve().parent.parent / "book" / "chapters"
EXERCISE = re.compile(r"^\*\*(\d+)\.", re.M)



def is_solution(cell) -> bool:
    tags = set(cell.metadata.get("tags", []))
    label = cell.metadata.get("mystnb", {}).get("code_prompt_show", "")
    return cell.cell_type == "code" and "hide-cell" in tags and label == "Show solution"


def exercises(path: Path) -> dict[int, int]:
    """{exercise number: how many solution cells follow it} for one chapter."""
    found: dict[int, int] = {}
    inside, current = False, None
    for cell in jupytext.read(path).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    inside = line.strip() == "## Exercises"
                    current = None
                elif inside and (m := EXERCISE.match(line)):
                    current = int(m.group(1))
                    found[current] = 0
        elif inside and current is not None and is_solution(cell):
            found[current] += 1
    return found


def missing(chapter: str, found: dict[int, int]) -> list[str]:
    out = []
    if not found:
        out.append(f"{chapter}: no `## Exercises` section with `**1. ...**` exercises")
    if list(found) != list(range(1, len(found) + 1)):
        out.append(f"{chapter}: exercises numbered {list(found)}, not 1..{len(found)}")
    for number, solutions in found.items():
        if solutions != 1:
            out.append(f"{chapter}: exercise {number} has {solutions} solution cells "
                       "(one hidden 'Show solution' cell after it)")
    return out


@pytest.mark.parametrize("chapter", sorted(p.name for p in CHAPTERS.glob("[0-9][0-9]_*.md")))
def test_every_exercise_has_one_solution(chapter):
    problems = missing(chapter, exercises(CHAPTERS / chapter))
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_missing_solution(tmp_path):
    solution = ("```{code-cell} ipython3\n---\ntags: [hide-cell]\nmystnb:\n"
                "  code_prompt_show: Show solution\n  code_prompt_hide: Hide solution\n"
                "---\nassert True\n```\n")
    path = tmp_path / "99_toy.md"
    path.write_text("---\njupytext:\n  text_representation:\n    extension: .md\n"
                    "    format_name: myst\n---\n\n# Toy\n\n## Exercises\n\n"
                    "**1. One.** Do it.\n\n" + solution + "\n**2. Two.** Do it too.\n\n"
                    "## Further reading\n\n```{code-cell} ipython3\n---\ntags: [hide-cell]\n"
                    "mystnb:\n  code_prompt_show: Show solution\n---\n1\n```\n")
    found = exercises(path)
    assert found == {1: 1, 2: 0}                   # a cell after the section is not one
    assert missing("99_toy.md", found) == [
        "99_toy.md: exercise 2 has 0 solution cells (one hidden 'Show solution' cell after it)"]
    assert missing("11_build_it.md", {1: 1, 2: 1, 3: 2}) == [
        "11_build_it.md: exercise 3 has 2 solution cells (one hidden 'Show solution' cell "
        "after it)"]
