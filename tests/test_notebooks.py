"""Every notebook under notebooks/ runs top to bottom without an error, on a kernel of this Python (the venv's).

The kernel is declared in a temporary Jupyter data directory (JUPYTER_PATH), so the test needs no kernel installed
in the user's or the system's Jupyter paths.  One kernel runs the notebooks in turn, to pay for its start and for the
imports (ggml, matplotlib) once: before each notebook its namespace is cleared (``%reset -f``) and its working
directory set to notebooks/, so a notebook that relies on another's names fails; a kernel that died is replaced.
The notebooks are stored without outputs: a stored output fails the test (clear them before committing).
"""
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed (pip install -e .[notebooks])")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra is not installed (pip install -e .[notebooks])")
pytest.importorskip("ipykernel", reason="the notebooks extra is not installed (pip install -e .[notebooks])")
pytest.importorskip("matplotlib", reason="the notebooks extra is not installed (pip install -e .[notebooks])")
from jupyter_core.utils import run_sync  # noqa: E402  (a dependency of nbclient)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
KERNEL = "kvcache-ggml-test"
CELL_TIMEOUT = 120  # seconds per cell: a hung cell fails instead of hanging the suite


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec running this interpreter, visible through JUPYTER_PATH, and a private IPython directory."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kvcache_ggml tests", "language": "python",
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline", "PYDEVD_DISABLE_FILE_VALIDATION": "1"},
    }))
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "IPYTHONDIR")}
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), saved["JUPYTER_PATH"]]))
    os.environ["IPYTHONDIR"] = str(root / "ipython")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_the_seven_notebooks_are_there():
    assert [p.stem[:2] for p in PATHS] == ["01", "02", "03", "04", "05", "06", "07"], [p.name for p in PATHS]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_stored_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    dirty = [i for i, c in enumerate(book.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


@pytest.fixture(scope="module")
def kernel(kernel_env):
    """The kernel manager shared by the notebooks of this module (None until the first notebook starts one)."""
    holder = {"km": None}
    yield holder
    _shutdown(holder)


def _shutdown(holder):
    km, holder["km"] = holder["km"], None
    if km is not None and km.has_kernel:
        run_sync(km.shutdown_kernel)(now=True)


def _prelude():
    """The cell run before each notebook: a clean namespace, notebooks/ as the working directory."""
    return nbformat.v4.new_code_cell(f"%reset -f\nimport os as _os\n_os.chdir({str(NOTEBOOKS)!r})\ndel _os")


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, kernel):
    book = nbformat.read(path, as_version=4)
    book.cells.insert(0, _prelude())
    km = kernel["km"]
    if km is not None and not run_sync(km.is_alive)():
        _shutdown(kernel)
        km = None
    client = nbclient.NotebookClient(book, timeout=CELL_TIMEOUT, kernel_name=KERNEL, km=km,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    try:
        client.execute(cleanup_kc=False)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell raised\n{e}", pytrace=False)
    except nbclient.exceptions.DeadKernelError:
        pytest.fail(f"{path.name}: the kernel died (a native abort?); its output:\n"
                    + _outputs_text(book), pytrace=False)
    finally:
        kernel["km"] = client.km
        if client.kc is not None:
            client.kc.stop_channels()
    elapsed = time.perf_counter() - t0
    cells = [c for c in book.cells[1:] if c.cell_type == "code"]
    errors = [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
    images = sum("image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})
                 for c in cells for o in c.outputs)
    assert images >= 1, f"{path.name}: no figure was shown"
    assert elapsed < 60, f"{path.name} took {elapsed:.0f} s"


def _outputs_text(book) -> str:
    return "".join(o.get("text", "") for c in book.cells if c.cell_type == "code" for o in c.get("outputs", []))[-2000:]
