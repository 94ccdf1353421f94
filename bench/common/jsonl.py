"""Reading the bench scripts' result folders: one JSON record per line, in one or more .jsonl files."""
import json
from pathlib import Path


def records(folder, names):
    """Every record of the files `names` in `folder`, file by file, in order; a missing file or a blank line is
    skipped (a run may have measured only one implementation)."""
    for name in names:
        path = Path(folder) / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)
