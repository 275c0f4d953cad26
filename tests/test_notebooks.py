"""The notebooks in notebooks/ execute without error on the venv's Python, and are stored without outputs.

Each notebook runs in a fresh kernel from a kernelspec written to a temporary directory for this test
(``JUPYTER_PATH`` points there first), so the kernel is this interpreter whatever kernelspecs the
machine has; a final injected cell checks that. The working directory is notebooks/, as in Jupyter;
run_tour.ipynb gets ``PASSRATE_RUN_DIR`` in tmp_path and trains its tiny run there. How long each takes
is measured by benchmarks/notebooks.py (target: under 2 minutes each), not asserted here.
"""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"why_50_percent.ipynb", "sara_predictor.ipynb", "prefix_sampling_controller.ipynb",
            "run_tour.ipynb", "allocation_sweeps.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.fixture(scope="module")
def kernel_path(tmp_path_factory):
    """A 'python3' kernelspec for this interpreter in a temporary prefix, first on JUPYTER_PATH."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name="python3", display_name="Python 3 (passrate-jax tests)", prefix=str(prefix))
    return prefix / "share" / "jupyter"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, kernel_path, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(kernel_path), os.environ.get("JUPYTER_PATH")])))
    monkeypatch.setenv("PASSRATE_RUN_DIR", str(tmp_path / "run"))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(repr(sys.prefix))"))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    assert printed.strip() == repr(sys.prefix), f"kernel ran {printed.strip()}, not this interpreter {sys.prefix!r}"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    if path.stem == "run_tour":
        assert (tmp_path / "run" / "metrics.jsonl").exists()
        assert (tmp_path / "run" / "plots" / "accuracy_vs_rollouts.png").exists()
