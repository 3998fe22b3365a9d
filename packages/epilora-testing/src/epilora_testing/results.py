"""The text of a result file (../shared/DESIGN.md section 6: `{"meta": ..., "rows": [...]}`).

One row a line, the meta indented: as readable and as diffable row by row as an indented file,
and about a fifth smaller, which matters because every device call carries the repository
(tracked files and the vLLM bundle within 64 MiB)."""

import json


def results_text(meta: dict, rows: list) -> str:
    """`{"meta": meta, "rows": rows}` as JSON, each row on its own line."""
    body = ",\n".join(json.dumps(row) for row in rows)
    return ('{"meta": ' + json.dumps(meta, indent=1) + ',\n"rows": [\n' + body
            + ("\n" if rows else "") + "]}\n")


def update_results(path, *, part: str, meta: dict, rows: list) -> None:
    """Write `rows` into the result file at `path` as its `part`, keeping the other parts' rows
    (a file that several device calls fill, e.g. the RL benchmark's memory and accuracy runs).
    Each row gets `"part": part`; `meta.parts[part]` is that run's meta, and the file's meta
    is the latest run's, with `parts` beside it."""
    from pathlib import Path

    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
    if any("part" not in r for r in old["rows"]):
        raise ValueError(f"{path}: rows without a part (a file not written by update_results)")
    parts = {k: v for k, v in old["meta"].get("parts", {}).items() if k != part}
    kept = [r for r in old["rows"] if r.get("part") != part and r.get("part") in parts]
    parts[part] = meta
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results_text({**meta, "parts": parts},
                                 kept + [{**r, "part": part} for r in rows]))
