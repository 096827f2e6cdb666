"""Benchmark prompt sets: Spec-Bench and HumanEvalFix jsonl files -> a list of BenchPrompt.

Two line formats are read (data/README.md says where the files come from):

    {"question_id": 82, "category": "writing", "turns": ["Draft an email ...", "Now critique it."]}
    {"task_id": "Python/0", "instruction": "Fix bugs in ...", "declaration": "def f(x):\n", "buggy_solution": "..."}

A Spec-Bench line keeps its category and turns (a multi-turn prompt is run turn after turn, each
turn's chat holding the earlier questions and answers). A HumanEvalFix line becomes one turn,
`instruction + "\\n\\n" + declaration + buggy_solution`, in category "code_edit".

    load_prompts("spec-bench", categories=["qa", "rag"], limit=2)   # 2 prompts each, in file order
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Sequence

from specdec.errors import SpecdecError

DATA = Path(__file__).resolve().parents[2] / "data"
SHORTCUTS = {
    "spec-bench": DATA / "spec_bench" / "dev.jsonl",
    "humanevalfix": DATA / "code_edit" / "humanevalfix_dev.jsonl",
}
CODE_EDIT = "code_edit"
ALL = "all"  # the report's row over every category: no prompt's category may take its name


class BenchPrompt(NamedTuple):
    category: str
    id: str
    turns: tuple[str, ...]


def resolve_prompts(name_or_path: str | Path) -> Path:
    """A shortcut (spec-bench, humanevalfix) or a path -> an existing jsonl file."""
    s = str(name_or_path)
    path = SHORTCUTS.get(s.lower(), Path(s).expanduser())
    if not path.is_file():
        hint = f" (shortcuts: {', '.join(SHORTCUTS)})" if s not in SHORTCUTS else ""
        raise SpecdecError(f"no such prompts file: {path}{hint}")
    return path


def parse_line(d: dict, where: str) -> BenchPrompt:
    """One jsonl record (either format) -> BenchPrompt."""
    if not isinstance(d, dict):
        raise SpecdecError(f"{where}: expected a JSON object")
    if "turns" in d:
        turns = d["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise SpecdecError(f"{where}: 'turns' must be a non-empty list of strings, none empty or only spaces "
                               "(generate refuses an empty prompt too)")
        category = d.get("category", "default")
        if not isinstance(category, str) or not category.strip() or category == ALL:
            raise SpecdecError(f"{where}: 'category' must be a non-empty string other than {ALL!r} (the report's "
                               f"row over every category), got {category!r}")
        return BenchPrompt(category, str(d.get("question_id", where)), tuple(turns))
    if "instruction" in d and "buggy_solution" in d:
        fields = {k: d.get(k, "") for k in ("instruction", "declaration", "buggy_solution")}
        bad = [k for k, v in fields.items() if not isinstance(v, str)]
        if bad:
            raise SpecdecError(f"{where}: {', '.join(map(repr, bad))} must be text, got "
                               f"{', '.join(type(fields[k]).__name__ for k in bad)}")
        text = fields["instruction"] + "\n\n" + fields["declaration"] + fields["buggy_solution"]
        if not text.strip():
            raise SpecdecError(f"{where}: the instruction and code are empty")
        return BenchPrompt(CODE_EDIT, str(d.get("task_id", where)), (text,))
    raise SpecdecError(f"{where}: neither a Spec-Bench line (turns) nor a HumanEvalFix line "
                       "(instruction, declaration, buggy_solution)")


def read_prompts(path: str | Path) -> list[BenchPrompt]:
    from specdec.options import decode_utf8

    path = resolve_prompts(path)
    out = []
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SpecdecError(f"cannot read the prompts file {path}: {e.strerror}") from None
    text = decode_utf8(data, f"the prompts file {path}")
    seen: dict[str, int] = {}
    for i, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        prompt = parse_line(d, f"{path.name}:{i}")
        if prompt.id in seen:  # the report pairs each method's run with plain's by (category, id, turn)
            raise SpecdecError(f"{path.name}:{i}: id {prompt.id!r} was used at line {seen[prompt.id]}: give each "
                               "prompt its own question_id / task_id")
        seen[prompt.id] = i
        out.append(prompt)
    if not out:
        raise SpecdecError(f"{path}: no prompts")
    return out


def categories_of(prompts: Sequence[BenchPrompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def select(prompts: Sequence[BenchPrompt], categories: Sequence[str] | None = None,
           limit: int | None = None) -> list[BenchPrompt]:
    """Keep the given categories (all when None) and the first `limit` prompts of each, in file order."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise SpecdecError(f"--limit must be at least 1, got {limit}")
    known = categories_of(prompts)
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpecdecError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                               f"{', '.join(map(repr, unknown))}: choose from {', '.join(known)}")
    wanted = set(categories) if categories else set(known)
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        if p.category in wanted and (limit is None or counts.get(p.category, 0) < limit):
            counts[p.category] = counts.get(p.category, 0) + 1
            out.append(p)
    return out


def load_prompts(name_or_path: str | Path, categories: Sequence[str] | None = None,
                 limit: int | None = None) -> list[BenchPrompt]:
    return select(read_prompts(name_or_path), categories, limit)
