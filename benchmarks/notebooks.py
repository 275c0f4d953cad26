"""Wall time of each notebook in notebooks/, executed as tests/test_notebooks.py does (a fresh kernel on
this interpreter, working directory notebooks/, run_tour.ipynb's run in a temporary directory).

    PYTHONPATH=. python benchmarks/notebooks.py --json

Target: each notebook under 120 s on the project's 2-core CPU, so that `pytest -n 2` stays within its
10 minutes. Reported with ``load_avg_1m`` (the machine is shared) and whether each met the target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat
from ipykernel.kernelspec import install

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 120.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebook stems (default: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    paths = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if not args.names or p.stem in args.names]
    out = {"load_avg_1m": round(os.getloadavg()[0], 2), "target_s": TARGET_S, "notebooks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        install(kernel_name="python3", display_name="Python 3 (passrate-jax benchmark)", prefix=tmp)
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [f"{tmp}/share/jupyter", os.environ.get("JUPYTER_PATH")]))
        for path in paths:
            os.environ["PASSRATE_RUN_DIR"] = f"{tmp}/{path.stem}_run"
            nb = nbformat.read(path, as_version=4)
            start = time.perf_counter()
            nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                    resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
            seconds = time.perf_counter() - start
            out["notebooks"][path.stem] = {"seconds": round(seconds, 1), "meets_target": seconds < TARGET_S}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
