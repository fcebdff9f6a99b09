"""The GPU check's offline install path (scripts/gpu_check.sh + build.py's .carry/), without a GPU or the network.

* the script reads the MANIFEST build.py writes: the files it installs, in order, and it refuses altered files;
* everything the project needs at run time is carried or on the GPU machine's image (build.IMAGE_PACKAGES),
  and so is everything the carried packages require;
* .carry/ (filled by `python3 build.py`, as CI runs it) is complete, pip resolves an install from it alone, and the
  payload that travels to a GPU machine is under 64 MiB;
* build.py's CUDA library discovery on a toolkit laid out like NVIDIA's pip wheels (cuBLAS from the nvidia-cublas
  wheel, no driver stub) and like a full toolkit.

The whole dry run (venv, offline install, ggml build, checks on a loopback RPC server) is too slow for the default
suite; docs/parity.md says how to run it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # scikit-build-core's dependency

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _load_build():
    spec = importlib.util.spec_from_file_location("kvcache_build", ROOT / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


build = _load_build()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return norm(Requirement(req).name)


def needed(requires: list[str]) -> set[str]:
    """Names of the requirements of a plain install (no extras) on the GPU machine's Python."""
    env = {"python_version": build.CARRY_PYTHON, "python_full_version": f"{build.CARRY_PYTHON}.0", "extra": "",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    return {norm(r.name) for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(env)}


def carried_names() -> set[str]:
    return {norm(req.partition("==")[0]) for req in build.CARRY_WHEELS} | {"ggml-python"}


def need_carry() -> None:
    if not (build.CARRY / "MANIFEST").exists():
        msg = ".carry/ is missing: `python3 build.py` (or `python3 build.py carry`) fills it"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI's build.py run must have made it
        pytest.skip(msg)


def plan(carry: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--plan"], env=dict(os.environ, GPU_CHECK_CARRY=str(carry)),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)


# ---- the manifest between build.py and the script -----------------------------------------------------------

def test_script_installs_what_build_py_lists(tmp_path):
    names = build.carry_plan()
    assert names[-1] == build.SDIST.name and all(n.endswith("-py3-none-any.whl") for n in names[:-1])
    for i, n in enumerate(names):
        (tmp_path / n).write_bytes(os.urandom(100 + i))
    build.write_manifest(tmp_path, names)
    assert [n for _, n in build.read_manifest(tmp_path)] == names
    proc = plan(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == names  # the same files, in install order: wheels, then the sdist

    with open(tmp_path / names[0], "r+b") as f:  # one altered byte: refused
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    proc = plan(tmp_path)
    assert proc.returncode != 0 and "do not match" in proc.stderr and names[0] in proc.stderr
    (tmp_path / "MANIFEST").unlink()
    proc = plan(tmp_path)
    assert proc.returncode != 0 and "build.py carry" in proc.stderr


def test_manifest_lines_are_checked(tmp_path):
    (tmp_path / "MANIFEST").write_text("abc  x.whl\n")
    with pytest.raises(build.SetupError, match="line 1"):
        build.read_manifest(tmp_path)


# ---- what the GPU machine has, and what is carried --------------------------------------------------------------

def test_project_dependencies_are_carried_or_on_the_image():
    block = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    deps = re.findall(r'^\s*"([^"]+)"', block, re.M)
    assert deps and any(d.startswith("numpy") for d in deps)
    missing = needed(deps) - carried_names() - {norm(p) for p in build.IMAGE_PACKAGES}
    assert not missing, f"carry these (build.CARRY_WHEELS) or check the GPU image has them: {sorted(missing)}"
    pins = {requirement_name(d): d for d in deps}
    assert pins["ggml-python"].endswith(f"=={build.GGML_PYTHON_VERSION}")


def _metadata_requires(carry: Path) -> dict[str, list[str]]:
    """Requires-Dist of each carried distribution, read from the carried files."""
    out = {}
    for _, name in build.read_manifest(carry):
        path = carry / name
        if name.endswith(".whl"):
            with zipfile.ZipFile(path) as z:
                meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        else:
            with tarfile.open(path) as t:
                meta = t.extractfile(next(m for m in t.getmembers() if m.name.count("/") == 1
                                          and m.name.endswith("/PKG-INFO"))).read().decode()
        msg = Parser().parsestr(meta)
        out[norm(msg["Name"])] = msg.get_all("Requires-Dist") or []
    return out


def test_carried_packages_need_only_carried_or_image_packages():
    need_carry()
    requires = _metadata_requires(build.CARRY)
    assert set(requires) == carried_names()
    have = carried_names() | {norm(p) for p in build.IMAGE_PACKAGES}
    for dist, reqs in requires.items():
        assert needed(reqs) <= have, f"{dist} requires {sorted(needed(reqs) - have)}: carry them too"


def test_carry_folder_is_complete_and_the_payload_fits():
    need_carry()
    assert build.carry_complete(), "run `python3 build.py carry`: .carry/ differs from its plan or MANIFEST"
    if not (ROOT / ".git").exists():  # a copy of the tree (scripts/mutation_check.py): what travels is git's list
        pytest.skip("not a git checkout: the payload is the files git lists")
    tree, carried = build.payload_sizes()
    assert 0 < carried and 0 < tree
    assert tree + carried < build.PAYLOAD_LIMIT, f"{(tree + carried) / 2**20:.1f} MiB would travel"


def test_pip_resolves_the_install_from_the_carried_files_alone(tmp_path):
    """What the script installs, resolved by pip with no index and no configuration: the pinned versions."""
    need_carry()
    files = [str(build.CARRY / n) for _, n in build.read_manifest()]
    report = tmp_path / "report.json"
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        env.pop(var, None)
    # --target: an empty place, so pip installs rather than finds them installed; --no-deps: the test above
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
                           "--no-build-isolation", "--no-deps", "--find-links", str(build.CARRY), "--target",
                           str(tmp_path / "t"), "--report", str(report), *files], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    got = {(norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]}
    want = {(norm(r.partition("==")[0]), r.partition("==")[2]) for r in build.CARRY_WHEELS}
    assert got == want | {("ggml-python", build.GGML_PYTHON_VERSION)}


# ---- CUDA libraries -----------------------------------------------------------------------------------------

def _toolkit(tmp_path: Path, full: bool) -> Path:
    root = tmp_path / "cuda"
    (root / "include").mkdir(parents=True)
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so.13").write_bytes(b"")
    if full:
        (root / "include" / "cublas_v2.h").write_text("")
        (root / "lib64" / "libcublas.so").write_bytes(b"")
        (root / "lib64" / "stubs").mkdir()
        (root / "lib64" / "stubs" / "libcuda.so").write_bytes(b"")
    return root


def _cublas_wheel(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    base = site / "nvidia" / "cu13"
    (base / "include").mkdir(parents=True)
    (base / "lib").mkdir()
    (base / "include" / "cublas_v2.h").write_text("")
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (base / "lib" / lib).write_bytes(b"")
    return site


def test_cuda_args_with_cublas_from_the_wheel(tmp_path, monkeypatch):
    root = _toolkit(tmp_path, full=False)
    site = _cublas_wheel(tmp_path)
    monkeypatch.setattr(build, "_cuda_roots", lambda: [root])
    monkeypatch.setattr(build, "_nvcc_major", lambda: "13")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    links = tmp_path / "links"
    lib = site / "nvidia" / "cu13" / "lib"

    monkeypatch.setattr(build, "_system_libcuda", lambda: None)
    args = build.cuda_library_args(links)
    assert args[0] == "-DGGML_CUDA_NCCL=OFF"
    assert f"-DCUDA_cublas_LIBRARY={links / 'libcublas.so'}" in args
    assert f"-DCUDA_cublasLt_LIBRARY={links / 'libcublasLt.so'}" in args
    assert (links / "libcublas.so").resolve() == (lib / "libcublas.so.13").resolve()
    assert f"-DCMAKE_CUDA_FLAGS=-I{site / 'nvidia' / 'cu13' / 'include'}" in args
    assert "-DGGML_CUDA_NO_VMM=ON" in args  # no driver on this machine: nothing links libcuda
    assert args[-1] == f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,{lib.resolve()}:{(root / 'lib64').resolve()}"

    driver = tmp_path / "drv" / "libcuda.so.1"
    driver.parent.mkdir()
    driver.write_bytes(b"")
    monkeypatch.setattr(build, "_system_libcuda", lambda: driver)
    args = build.cuda_library_args(links)
    assert f"-DCUDA_cuda_driver_LIBRARY={links / 'libcuda.so'}" in args and "-DGGML_CUDA_NO_VMM=ON" not in args
    assert (links / "libcuda.so").resolve() == driver.resolve()


def test_cuda_args_with_a_full_toolkit_and_without_cublas(tmp_path, monkeypatch):
    root = _toolkit(tmp_path, full=True)
    monkeypatch.setattr(build, "_cuda_roots", lambda: [root])
    monkeypatch.setattr(build, "_system_libcuda", lambda: None)
    assert build.cuda_library_args(tmp_path / "links") == [
        "-DGGML_CUDA_NCCL=OFF", f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,{(root / 'lib64').resolve()}"]

    bare = _toolkit(tmp_path / "bare", full=False)
    monkeypatch.setattr(build, "_cuda_roots", lambda: [bare])
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing")])
    with pytest.raises(build.SetupError, match="cuBLAS not found"):
        build.cuda_library_args(tmp_path / "links")
