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
