"""Every figure README.md and docs/ quote is read from a committed results file.

The convention (docs/results.md, the measurements the README's "Results" points to): a measured figure is the text of
a Markdown link to the results file it comes from, and the link's title says where in that file:

- a ``.json`` file: one JSON pointer per number in the link text, separated by ``;``. A pointer is ``/``-separated
  keys and list indices, where a segment ``[key=value,key=value]`` selects the one list element whose fields have
  those values (``/rows/[k=16,family=columns]/heldout``); a trailing ``*100`` scales the value (percentages).
  Each number of the link text must equal the value rounded to the decimals the text shows. An item
  ``pointer=literal`` checks a non-numeric entry instead (``/goals/0/decided=false``).
- a ``.md`` file: a quote that must occur in the file (whitespace normalised) and that contains every number of
  the link text.

    [0.970x (0.955–0.993)](benchmarks/results/model_study.json "/model/2/ratio; /model/2/ratio_interval/0; ...")

A figure that drifts from its file (the file is rerun, or the README edited) fails ``test_figures_match``; a
measurement written into README.md without such a link fails ``test_no_unlinked_measurements``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"  # the measurement-by-measurement page behind the README's "At a glance"
DOCS = sorted((ROOT / "docs").glob("*.md"))

# A Markdown link with a title: [text](path "title").
LINK = re.compile(r'\[([^\]]*)\]\(([^)\s]+)\s+"([^"]*)"\)')
NUMBER = re.compile(r"(?<![\w.])[-−+]?\d+(?:\.\d+)?(?![\w.]*\d)")
RESULT_DIRS = ("results/", "benchmarks/results/")


def _numbers(text: str) -> list[str]:
    return [m.group(0).replace("−", "-").lstrip("+") for m in NUMBER.finditer(text)]


def _strip_code(text: str) -> str:
    # Line numbers survive: a code block leaves its newlines behind.
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def figure_links(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, link text, target, title) of every titled link to a results file in ``path``."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in LINK.finditer(text):
        target = m.group(2).split("#")[0]
        resolved = (path.parent / target).resolve().relative_to(ROOT).as_posix()
        if resolved.startswith(RESULT_DIRS):
            out.append((text.count("\n", 0, m.start()) + 1, m.group(1), resolved, m.group(3)))
    return out


def _select(items: list, selector: str):
    conditions = dict(c.split("=", 1) for c in selector.split(","))
    hits = [item for item in items if isinstance(item, dict)
            and all(str(item.get(key)) == value for key, value in conditions.items())]
    if len(hits) != 1:
        raise KeyError(f"[{selector}] matches {len(hits)} entries, not one")
    return hits[0]


def resolve(data, pointer: str):
    """The entry of ``data`` at ``pointer`` (see the module docstring)."""
    if not pointer.startswith("/"):
        raise KeyError(f"{pointer!r} does not start with '/'")
    value = data
    for segment in re.findall(r"\[[^\]]*\]|[^/]+", pointer):
        segment = segment.replace("~1", "/").replace("~0", "~")
        if segment.startswith("["):
            value = _select(value, segment[1:-1])
        elif isinstance(value, list):
            value = value[int(segment)]
        else:
            value = value[segment]
    return value


def _formatted(value: float, shown: str) -> str:
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    text = f"{value:.{decimals}f}"
    return text.lstrip("-") if float(text) == 0 else text


def check_figure(text: str, target: str, title: str) -> list[str]:
    """What is wrong with one figure link (empty: nothing)."""
    path = ROOT / target
    if not path.is_file():
        return [f"{target} does not exist"]
    numbers = _numbers(text)
    if path.suffix == ".md":
        quote = " ".join(title.split())
        body = " ".join(path.read_text(encoding="utf-8").split())
        problems = [] if quote in body else [f"{target} does not contain {quote!r}"]
        quoted = _numbers(quote)
        problems += [f"{n} is not in the quote {quote!r}" for n in numbers if n not in quoted]
        return problems
    if path.suffix != ".json":
        return [f"{target}: figures are read from .json or .md files"]
    data = json.loads(path.read_text(encoding="utf-8"))
    items = [item.strip() for item in title.split(";") if item.strip()]
    literals = [item for item in items if re.search(r"=[^=\]]*$", item) and not item.endswith("]")]
    pointers = [item for item in items if item not in literals]
    problems = []
    for item in literals:
        pointer, expected = item.rsplit("=", 1)
        try:
            found = json.dumps(resolve(data, pointer))
        except (KeyError, IndexError, ValueError, TypeError) as error:
            problems.append(f"{target}#{pointer}: {error}")
            continue
        if found != expected:
            problems.append(f"{target}#{pointer} is {found}, the README says {expected}")
    if len(pointers) != len(numbers):
        return problems + [f"{text!r}: {len(numbers)} numbers but {len(pointers)} pointers in {title!r}"]
    for shown, pointer in zip(numbers, pointers):
        scale = 1.0
        if re.search(r"\*\d+(\.\d+)?$", pointer):
            pointer, factor = pointer.rsplit("*", 1)
            scale = float(factor)
        try:
            value = resolve(data, pointer)
        except (KeyError, IndexError, ValueError, TypeError) as error:
            problems.append(f"{target}#{pointer}: {error}")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"{target}#{pointer} is {value!r}, not a number")
            continue
        expected = _formatted(value * scale, shown)
        if shown != expected:
            problems.append(f"README says {shown}, {target}#{pointer} gives {expected} ({value!r})")
    return problems


def test_results_page_quotes_figures():
    # The convention is in use: the figures of the results page are links (not, say, all dropped by an edit).
    assert len(figure_links(RESULTS)) >= 40


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_figures_match(path):
    problems = [f"{path.name}:{line}: {problem}" for line, text, target, title in figure_links(path)
                for problem in check_figure(text, target, title)]
    assert not problems, "\n".join(problems)


# What reads as a measurement: a decimal number, a percentage, a ratio (0.97x), a duration or a memory size.
MEASUREMENT = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:%|x\b|×|ms\b|s\b|min\b|h\b|GiB\b|MiB\b)"
    r"|(?<![\w.])\d*\.\d+(?![\w.]*\d)")
# Configuration constants and versions the README may state without a results file.
ALLOWED = re.compile(r"Python \d+\.\d+|arXiv:\d+\.\d+|arxiv\.org/abs/\d+\.\d+"
                     r"|torch \d+\.\d+(?:\.\d+)?|by more than \d+ %")


@pytest.mark.parametrize("path", [README, RESULTS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_unlinked_measurements(path):
    text = _strip_code(path.read_text(encoding="utf-8"))
    text = LINK.sub(lambda m: "FIGURE" if (path.parent / m.group(2).split("#")[0]).resolve().relative_to(ROOT)
                    .as_posix().startswith(RESULT_DIRS) else m.group(0), text)
    text = ALLOWED.sub("", text)
    unlinked = [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in MEASUREMENT.finditer(text)]
    assert not unlinked, f"measurements in {path.name} without a results link: {unlinked}"


def test_checker_catches_a_drifted_figure():
    # The check itself can fail: a figure one digit off its file, a wrong pointer, a missing quote.
    line, text, target, title = next(f for f in figure_links(RESULTS) if f[2].endswith(".json") and "x" in f[1])
    assert not check_figure(text, target, title)
    shown = _numbers(text)[0]
    drifted = text.replace(shown, shown[:-1] + str((int(shown[-1]) + 1) % 10), 1)
    assert check_figure(drifted, target, title)
    assert check_figure(text, target, title.replace("/", "/nope/", 1))
    assert check_figure("56 %", "results/table1/table1.md", "57 % recovered")


if __name__ == "__main__":  # python tests/test_readme_figures.py: every figure link, and what is wrong with it
    for doc in (README, *DOCS):
        for line, text, target, title in figure_links(doc):
            problems = check_figure(text, target, title)
            print(f"{doc.name}:{line}: {text!r} <- {target}: {'; '.join(problems) or 'ok'}")
