"""Execute every notebook in notebooks/ against results/ and save it with its outputs, so that a
reader on GitHub sees the tables and figures (one command; nothing is trained inside):

    python experiments/run_notebooks.py [NOTEBOOK ...]

Each notebook is written to a temporary sibling and renamed. tests/test_notebooks.py executes them
again and fails when a committed notebook's text outputs disagree with what results/ gives now.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata.pop("widgets", None)
    return nb


def main(paths: list[str]) -> None:
    notebooks = [Path(p) for p in paths] or sorted((REPO / "notebooks").glob("*.ipynb"))
    for path in notebooks:
        nb = execute(path)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
        if errors:
            sys.exit(f"{path}: a cell failed ({errors[0].ename}: {errors[0].evalue}); not saved")
        tmp = path.with_name(f".{path.name}.tmp")
        nbformat.write(nb, tmp)
        tmp.replace(path)
        print(f"executed and saved {path.resolve().relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
