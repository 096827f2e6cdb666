"""The library never depends on the command line: no module outside specdec/commands and specdec/cli.py
imports them (at the top or inside a function), so the package has no import cycle through its CLI."""

import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_library_modules_do_not_import_the_cli():
    library = [p for p in ROOT.rglob("*.py") if "commands" not in p.relative_to(ROOT).parts and p.name != "cli.py"]
    assert len(library) > 20
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in imported(p) if n.startswith(("specdec.commands", "specdec.cli")))
                 for p in library}
    assert {p: n for p, n in offenders.items() if n} == {}
