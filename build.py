#!/usr/bin/env python3
"""Set up kvcache_ggml on a fresh machine (Python >= 3.10, a C/C++ compiler, cmake) and run it.

    python3 build.py [build options]                     set up the flavour's venv only (.venv/ by default)
    python3 build.py [build options] test [pytest args]  set up, then <venv>/bin/python -m pytest ...
    python3 build.py [build options] demo [demo args]    set up, then <venv>/bin/python -m kvcache_ggml demo ...
    python3 build.py carry                               fill .carry/ only (no set-up): the GPU check's payload
    python3 build.py [build options] cmake-args          print the CMAKE_ARGS a ggml build with these options uses

Set-up: creates the flavour's venv, installs the build dependencies, downloads the pinned ggml-python source
package into vendor/, unpacks it under vendor/ggml/ and applies GGML_PATCHES, builds and installs it with the
requested ggml backends (CPU always, RPC by default), then installs this project editable with its fast and test
extras (`test` adds the notebooks extra), compiles the graph builders' C calls with cffi into the venv (optional:
ctypes serves without them), and fills .carry/ (see below). A stamp file in the venv records what was done; a re-run
with the same flags does nothing. Standard library only.

Flavours: each set of build options has its own venv, so flavours coexist: the default (CPU + RPC, CPU code for
this machine) lives in .venv/, every other in .venv-<flavour>/, named by its non-default options in a fixed order
(.venv-vulkan/, .venv-avx2/, .venv-asan/, .venv-vulkan-asan/, ...; BuildFlags.flavour). `test` and `demo` run in the
flavour the options name: `python3 build.py --vulkan test -m vulkan` never touches .venv/.

.carry/ (git-ignored) is what scripts/gpu_check.sh installs on a GPU machine with no network: the pinned ggml-python
source package and the pure-Python wheels that machine's image lacks (CARRY_WHEELS), with MANIFEST, in
`sha256sum -c` format, listing them in install order. `carry` also prints the payload that travels with the
repository to such a machine (tracked files + .carry/) against its 64 MiB limit.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if sys.version_info < (3, 10):
    sys.exit(f"build.py: error: Python {sys.version.split()[0]} is too old: kvcache_ggml needs Python >= 3.10")

ROOT = Path(__file__).resolve().parent
STAMP_NAME = ".kvcache_build.json"  # in each flavour's venv
VENDOR = ROOT / "vendor"
VENDOR_GGML = VENDOR / "ggml"
LOCK = VENDOR / ".build.lock"

GGML_PYTHON_VERSION = "0.0.45"
# sha256 of ggml_python-0.0.45.tar.gz as published on PyPI
GGML_PYTHON_SHA256 = "10aac52075cf3c7ef2b00d6c35b1c23f7b018dbeff8ae8df67339b4be1166f05"
SDIST = VENDOR / f"ggml_python-{GGML_PYTHON_VERSION}.tar.gz"
SOURCE = VENDOR_GGML / f"ggml_python-{GGML_PYTHON_VERSION}"
BUILD_DEPS = ("numpy>=1.24", "scikit-build-core>=0.10", "setuptools>=70.1", "typing_extensions>=4.6.3")
CMAKE_MIN = (3, 21)  # ggml-python's CMakeLists.txt requires 3.21
# extras of this project each command needs (the notebooks extra runs the notebook tests)
COMMAND_EXTRAS = {None: ("fast", "test", "text", "serve"), "test": ("fast", "test", "notebooks", "text", "serve"),
                  "demo": ("fast", "test", "text", "serve")}
STAMP_SCHEMA = 1
GGML_RECIPE = 3  # bump when the way ggml-python is built changes: forces one rebuild (3: GGML_LLAMAFILE=ON)
COMMANDS = ("test", "demo", "carry", "cmake-args", "patch-source")

# the GPU check's offline payload (scripts/gpu_check.sh, docs/parity.md)
CARRY = ROOT / ".carry"
CARRY_MANIFEST = CARRY / "MANIFEST"
CARRY_PYTHON = "3.12"  # the GPU machine's python3 (the wheels must be pure Python or built for it)
# pure-Python wheels the GPU machine's image lacks: what kvcache_ggml imports at run time besides numpy and ggml
CARRY_WHEELS = ("gguf==0.19.0",)
# what the GPU machine's image provides (its package list) that the carried packages, the build of ggml-python and
# the project need: a carried package requiring anything else must be carried too (tests/test_gpu_check.py checks)
IMAGE_PACKAGES = ("numpy", "pyyaml", "requests", "tqdm", "typing-extensions", "scikit-build-core", "setuptools",
                  "packaging", "pathspec", "cmake", "ninja", "pytest", "hypothesis")
PAYLOAD_LIMIT = 64 * 2**20  # bytes that may travel to the GPU machine: tracked files + carried paths
NETWORK_HINTS = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "ConnectionError", "ReadTimeoutError",
    "No matching distribution found", "Could not find a version that satisfies",
)


class SetupError(Exception):
    """A failure with a one-line explanation for the user."""


@dataclass(slots=True, frozen=True)
class BuildFlags:
    cuda: bool  # -DGGML_CUDA
    cuda_arch: str  # CMAKE_CUDA_ARCHITECTURES ("" = ggml's default)
    metal: bool  # -DGGML_METAL
    vulkan: bool  # -DGGML_VULKAN
    rpc: bool  # -DGGML_RPC (default on)
    vulkan_headers: str = ""  # absolute path of a folder with newer vulkan/*.hpp headers ("" = the system's)
    avx2: bool = False  # the CPU backend for AVX2 machines (GGML_NATIVE=OFF), not for this CPU's every feature
    asan: bool = False  # ggml with AddressSanitizer + UndefinedBehaviorSanitizer (GGML_SANITIZE_*)

    def flavour(self) -> str:
        """The flavour's name: "" for the default (CPU + RPC, native CPU code), else its non-default parts joined
        by '-' ("vulkan", "cuda", "avx2", "vulkan-asan", ...).  Each flavour has its own venv, so they coexist."""
        parts = [n for n, on in (("cuda", self.cuda), ("metal", self.metal), ("vulkan", self.vulkan),
                                 ("norpc", not self.rpc), ("avx2", self.avx2), ("asan", self.asan)) if on]
        return "-".join(parts)

    @property
    def venv(self) -> Path:
        """.venv/ for the default flavour, .venv-<flavour>/ for the others."""
        name = self.flavour()
        return ROOT / (f".venv-{name}" if name else ".venv")

    def cmake_args(self) -> str:
        onoff = lambda b: "ON" if b else "OFF"  # noqa: E731
        args = [f"-DGGML_CUDA={onoff(self.cuda)}", f"-DGGML_METAL={onoff(self.metal)}",
                f"-DGGML_VULKAN={onoff(self.vulkan)}", f"-DGGML_RPC={onoff(self.rpc)}",
                # llama.cpp turns llamafile's sgemm on (ggml alone defaults it off); the CPU's F32/F16/Q8_0/Q4_0
                # matrix products of several tokens then take the same kernels as llama.cpp's, bit for bit
                # (docs/exactness.md)
                "-DGGML_LLAMAFILE=ON"]
        if self.cuda and self.cuda_arch:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}")
        if self.vulkan and self.vulkan_headers:
            # FindVulkan takes a preset include dir; its imported target puts it before /usr/include
            args.append(f"-DVulkan_INCLUDE_DIR={self.vulkan_headers}")
        if self.avx2:
            # what ggml's own x86 defaults give without GGML_NATIVE: SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no AVX-512
            args += ["-DGGML_NATIVE=OFF", *(f"-DGGML_{f}=ON" for f in ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C"))]
        if self.asan:
            # frame pointers and -O1 keep the reports' stacks whole; ggml adds -fsanitize=... to its targets
            args += ["-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                     "-DCMAKE_C_FLAGS=-fno-omit-frame-pointer", "-DCMAKE_CXX_FLAGS=-fno-omit-frame-pointer"]
        return " ".join(args)

    def backends(self) -> list[str]:
        return ["CPU"] + [n for n, on in (("CUDA", self.cuda), ("Metal", self.metal),
                                          ("Vulkan", self.vulkan), ("RPC", self.rpc)) if on]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, str | None, list[str]]:
    """Options before the first command word are ours; everything after it goes to the command."""
    split = next((i for i, a in enumerate(argv) if a in COMMANDS), len(argv))
    ours, command, rest = argv[:split], (argv[split] if split < len(argv) else None), argv[split + 1:]
    p = argparse.ArgumentParser(prog="build.py", description=__doc__.split("\n\n")[0],
                                epilog="commands: test [pytest args...], demo [demo args...], carry, cmake-args, "
                                       "patch-source DIR")
    p.add_argument("--cuda", action="store_true", help="build the CUDA backend")
    p.add_argument("--cuda-arch", default="", metavar="N", help="CMAKE_CUDA_ARCHITECTURES (with --cuda)")
    p.add_argument("--metal", action="store_true", help="build the Metal backend")
    p.add_argument("--vulkan", action="store_true", help="build the Vulkan backend (in .venv-vulkan/)")
    p.add_argument("--vulkan-headers", default=None, metavar="DIR",
                   help=f"with --vulkan: a folder holding vulkan/vulkan.hpp newer than the system's (default: "
                        f"${VULKAN_HEADERS_ENV}; scripts/vulkan_sw.sh prints one when the system's are too old)")
    p.add_argument("--avx2", action="store_true",
                   help="build the CPU backend for AVX2 (GGML_NATIVE=OFF: no AVX-512 even where this CPU has it)")
    p.add_argument("--asan", action="store_true",
                   help="build ggml with AddressSanitizer and UBSan; `test` then runs pytest with them preloaded")
    p.add_argument("--rpc", dest="rpc", action="store_true", default=True, help="build the RPC backend (default)")
    p.add_argument("--no-rpc", dest="rpc", action="store_false", help="do not build the RPC backend")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="parallel compile jobs (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="do not print the summary at the end")
    args = p.parse_args(ours)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.cuda_arch and not args.cuda:
        p.error("--cuda-arch needs --cuda")
    if args.vulkan_headers is not None and not args.vulkan:
        p.error("--vulkan-headers needs --vulkan")
    return args, command, rest


def say(msg: str) -> None:
    print(f"[build.py] {msg}", flush=True)


def run_logged(cmd: list[str], what: str, env: dict[str, str] | None = None, log: Path | None = None) -> None:
    """Run cmd; on failure raise SetupError with the tail of its output (kept in `log` when given)."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}")
    if proc.returncode != 0:
        lines = proc.stdout.rstrip().splitlines()
        tail = "\n".join(lines[-40:])
        if any(h in proc.stdout for h in NETWORK_HINTS):
            raise SetupError(f"{what} failed: cannot download packages (no network or no package index?)\n{tail}")
        where = f" (full log: {log.relative_to(ROOT)})" if log is not None else ""
        raise SetupError(f"{what} failed with exit code {proc.returncode}{where}; last lines:\n{tail}")
    say(f"{what}: done in {time.monotonic() - t0:.1f} s")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip(*args: str, python: Path | str) -> list[str]:
    return [str(python), "-m", "pip", "--disable-pip-version-check", *args]


# ---- checks of the host -------------------------------------------------------------------------------------

VULKAN_HEADERS_ENV = "KVCACHE_VULKAN_HEADERS"
# ggml-vulkan (ggml 0.9.x) uses vk::LayerSettingEXT (VK_EXT_layer_settings): Vulkan-Hpp 1.3.268 and later
VULKAN_NEEDS = "LayerSettingEXT"


def vulkan_headers_dir(args: argparse.Namespace) -> str:
    """The --vulkan-headers folder (or $KVCACHE_VULKAN_HEADERS), absolute and checked; "" for the system's."""
    if not args.vulkan:
        return ""
    given = args.vulkan_headers if args.vulkan_headers is not None else os.environ.get(VULKAN_HEADERS_ENV, "")
    if not given:
        return ""
    d = Path(given).expanduser().resolve()
    if not (d / "vulkan" / "vulkan.hpp").is_file():
        raise SetupError(f"--vulkan-headers {given!r}: {d / 'vulkan' / 'vulkan.hpp'} does not exist (give the "
                         f"folder that holds vulkan/, e.g. the one scripts/vulkan_sw.sh prints)")
    return str(d)


def check_vulkan_toolchain(flags: BuildFlags) -> None:
    """What ggml-vulkan's build needs, checked before a long build fails: glslc, and Vulkan-Hpp headers new
    enough (the system's, or flags.vulkan_headers)."""
    if not shutil.which("glslc"):
        raise SetupError("glslc not found on PATH: ggml-vulkan compiles its shaders with it (Debian/Ubuntu: run "
                         "scripts/vulkan_sw.sh as root, or install the LunarG Vulkan SDK)")
    inc = Path(flags.vulkan_headers) if flags.vulkan_headers else Path("/usr/include")
    structs = inc / "vulkan" / "vulkan_structs.hpp"
    if not structs.is_file():
        raise SetupError(f"no Vulkan-Hpp headers at {structs.parent} (Debian/Ubuntu: libvulkan-dev; or "
                         f"--vulkan-headers DIR)")
    if VULKAN_NEEDS not in structs.read_text(errors="replace"):
        m = re.search(r"VK_HEADER_VERSION\s+(\d+)", (inc / "vulkan" / "vulkan_core.h").read_text(errors="replace")) \
            if (inc / "vulkan" / "vulkan_core.h").is_file() else None
        have = f"1.x.{m.group(1)}" if m else "of unknown version"
        raise SetupError(f"the Vulkan headers at {inc} ({have}) lack vk::{VULKAN_NEEDS}, which ggml-vulkan needs "
                         f"(Vulkan-Hpp >= 1.3.268): run scripts/vulkan_sw.sh as root and pass the folder it prints "
                         f"with --vulkan-headers (or ${VULKAN_HEADERS_ENV})")

def find_tool(env_var: str, names: tuple[str, ...]) -> str | None:
    if os.environ.get(env_var):
        return shutil.which(os.environ[env_var].split()[0])
    return next((p for p in map(shutil.which, names) if p), None)


def check_toolchain() -> None:
    if not find_tool("CC", ("gcc", "cc", "clang")):
        hint = f" (CC={os.environ['CC']!r} not found)" if os.environ.get("CC") else ""
        raise SetupError(f"no C compiler found{hint}: install gcc (looked for gcc, cc, clang on PATH)")
    if not find_tool("CXX", ("g++", "c++", "clang++")):
        hint = f" (CXX={os.environ['CXX']!r} not found)" if os.environ.get("CXX") else ""
        raise SetupError(f"no C++ compiler found{hint}: install g++ (looked for g++, c++, clang++ on PATH)")
    cmake = shutil.which("cmake")
    if not cmake:
        raise SetupError(f"cmake not found on PATH: install cmake >= {'.'.join(map(str, CMAKE_MIN))}")
    out = subprocess.run([cmake, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    if not m:
        raise SetupError(f"cannot read the cmake version from {cmake!r} (output: {out.strip()[:80]!r})")
    have = (int(m.group(1)), int(m.group(2)))
    if have < CMAKE_MIN:
        raise SetupError(f"cmake {have[0]}.{have[1]} at {cmake} is too old: ggml-python needs cmake >= "
                         f"{'.'.join(map(str, CMAKE_MIN))}")


# ---- the stamp ----------------------------------------------------------------------------------------------

def read_stamp(venv: Path) -> dict:
    try:
        return json.loads((venv / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}


def write_stamp(venv: Path, stamp: dict) -> None:
    tmp = venv / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    tmp.replace(venv / STAMP_NAME)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def venv_key() -> dict:
    # the venv only depends on the Python minor version (site-packages/pythonX.Y); ggml-python is pure ctypes
    return {"schema": STAMP_SCHEMA, "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "build_deps": list(BUILD_DEPS)}


def ggml_key(flags: BuildFlags) -> dict:
    built = tuple(b.lower() for b in flags.backends())
    return {"ggml_python": GGML_PYTHON_VERSION, "sha256": GGML_PYTHON_SHA256, "flags": asdict(flags),
            "recipe": GGML_RECIPE, "patches": patches_digest(built)}


def project_key(extras: tuple[str, ...]) -> dict:
    return {"pyproject_sha256": file_sha256(ROOT / "pyproject.toml"), "extras": ",".join(sorted(set(extras)))}


def installed_extras(stamp: dict) -> set[str]:
    """Extras of the install the stamp records, when it was made from the current pyproject.toml."""
    have = stamp.get("project") or {}
    if have.get("pyproject_sha256") != file_sha256(ROOT / "pyproject.toml"):
        return set()
    return {e for e in str(have.get("extras", "")).split(",") if e}


def ggml_libs_present(venv: Path) -> bool:
    return any(venv.glob("lib/python3*/site-packages/ggml/lib/libggml-base.*"))


# ---- the stages ---------------------------------------------------------------------------------------------

def stage_venv(venv: Path, stamp: dict) -> dict:
    if venv_python(venv).exists() and stamp.get("venv") == venv_key():
        return stamp
    say(f"creating {venv.relative_to(ROOT)}/ with {sys.executable} ({sys.version.split()[0]})")
    run_logged([sys.executable, "-m", "venv", "--clear", str(venv)], "venv")
    run_logged(pip("install", "--upgrade", *BUILD_DEPS, python=venv_python(venv)), "installing build dependencies "
               + ", ".join(re.split(r"[<>=]", d)[0] for d in BUILD_DEPS))
    stamp = {"venv": venv_key()}  # everything else is gone with --clear
    write_stamp(venv, stamp)
    return stamp


def fetch_sdist(python: Path | str) -> None:
    if SDIST.exists() and file_sha256(SDIST) == GGML_PYTHON_SHA256:
        return
    VENDOR.mkdir(exist_ok=True)
    say(f"downloading the ggml-python {GGML_PYTHON_VERSION} source package into {VENDOR.relative_to(ROOT)}/")
    run_logged(pip("download", "--no-deps", "--no-binary", ":all:", f"ggml-python=={GGML_PYTHON_VERSION}",
                   "-d", str(VENDOR), python=python), "download of ggml-python")
    if not SDIST.exists():
        raise SetupError(f"pip did not leave {SDIST.relative_to(ROOT)} (files in vendor/: "
                         f"{sorted(p.name for p in VENDOR.iterdir())})")
    got = file_sha256(SDIST)
    if got != GGML_PYTHON_SHA256:
        raise SetupError(f"{SDIST.name} has sha256 {got}, expected {GGML_PYTHON_SHA256}: delete it and retry")


# ---- patches to the pinned ggml ------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class SourcePatch:
    """One edit of the unpacked source package: ``old`` must occur exactly ``count`` times in ``path``; each becomes
    ``new``."""

    name: str     # short id, recorded in the unpacked tree's marker
    backend: str  # the ggml backend whose library it changes (a flavour without it is not rebuilt for it)
    path: str     # relative to the source package's root
    old: str      # the exact text replaced (the pinned source's)
    new: str      # what replaces it
    why: str      # one line; the docs have the full story and the reproduction
    count: int = 1  # occurrences of ``old`` expected (and replaced)


_RPC_CPP = "vendor/ggml/src/ggml-rpc/ggml-rpc.cpp"
_RPC_TRANSPORT = "vendor/ggml/src/ggml-rpc/transport.cpp"
_RPC_TRANSPORT_H = "vendor/ggml/src/ggml-rpc/transport.h"
_RPC_H = "vendor/ggml/include/ggml-rpc.h"


def _rpc(name: str, path: str, old: str, new: str, why: str) -> SourcePatch:
    return SourcePatch(name=name, backend="rpc", path=path, old=old, new=new, why=why)


# A dead RPC server is an exception, not an abort (issue 29; docs/parity.md "A dead RPC server"): ggml's client
# aborts the process when an exchange fails and blocks forever on a server that stopped answering. These edits
# give its sockets a send/receive timeout, shut a socket down at its first failure, count failures instead of
# aborting (the call returns with zeroed answers and a failed compute status), and export the count and each
# buffer's connection status, which kvcache_ggml reads after every call that touched an RPC server.
RPC_PATCHES: tuple[SourcePatch, ...] = (
    _rpc("rpc-transport-decls", _RPC_TRANSPORT_H,
"""    void get_caps(uint8_t * local_caps);
    void update_caps(const uint8_t * remote_caps);

    static socket_ptr create_server""",
"""    void get_caps(uint8_t * local_caps);
    void update_caps(const uint8_t * remote_caps);

    // kvcache_ggml (build.py): true once a send or a receive failed; the socket is then shut down
    bool broken() const;

    static socket_ptr create_server""", "a socket says whether it failed"),
    _rpc("rpc-transport-timeout-decl", _RPC_TRANSPORT_H,
"""bool rpc_transport_init();
""",
"""bool rpc_transport_init();
// kvcache_ggml (build.py): send/receive timeout of the sockets connected from now on (0: none, ggml's default)
void rpc_transport_set_timeout_ms(uint32_t ms);
""", "the client's socket timeout can be set"),
    _rpc("rpc-transport-includes", _RPC_TRANSPORT,
"""#include <cstdlib>
#include <mutex>
#include <optional>
""",
"""#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <optional>
""", "includes of the patches below"),
    _rpc("rpc-transport-failed-flag", _RPC_TRANSPORT,
"""    impl(sockfd_t fd) : use_rdma(false), fd(fd) {}
""",
"""    impl(sockfd_t fd) : use_rdma(false), fd(fd) {}
    // kvcache_ggml (build.py): after a failed send or receive the stream is out of step (a late answer would be
    // read as the next one): shut it down, so that every later call on it fails at once
    bool failed = false;
    void mark_failed() {
        if (!failed) {
            failed = true;
#ifdef _WIN32
            ::shutdown(fd, SD_BOTH);
#else
            ::shutdown(fd, SHUT_RDWR);
#endif
        }
    }
""", "a failed socket is shut down and stays failed"),
    _rpc("rpc-transport-send", _RPC_TRANSPORT,
"""        ssize_t n = send(fd, (const char *)data + bytes_sent, size_to_send, 0);
        if (n < 0) {
            GGML_LOG_ERROR("send failed (bytes_sent=%zu, size_to_send=%zu)\\n",
                           bytes_sent, size_to_send);
            return false;
        }""",
"""        if (failed) {
            return false;
        }
        ssize_t n = send(fd, (const char *)data + bytes_sent, size_to_send, 0);
        if (n < 0 && errno == EINTR) {
            continue;  // kvcache_ggml: a signal is not a dead server
        }
        if (n < 0) {
            GGML_LOG_ERROR("send failed (bytes_sent=%zu, size_to_send=%zu, %s)\\n",
                           bytes_sent, size_to_send, errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : "error");
            mark_failed();
            return false;
        }""", "send: EINTR retried, a failure marks the socket"),
    _rpc("rpc-transport-recv", _RPC_TRANSPORT,
"""        ssize_t n = recv(fd, (char *)data + bytes_recv, size_to_recv, 0);
        if (n < 0) {
            GGML_LOG_ERROR("recv failed (bytes_recv=%zu, size_to_recv=%zu)\\n",
                           bytes_recv, size_to_recv);
            return false;
        }
        if (n == 0) {
            LOG_DBG("recv returned 0 (peer closed?)\\n");
            return false;
        }""",
"""        if (failed) {
            return false;
        }
        ssize_t n = recv(fd, (char *)data + bytes_recv, size_to_recv, 0);
        if (n < 0 && errno == EINTR) {
            continue;  // kvcache_ggml: a signal is not a dead server
        }
        if (n < 0) {
            GGML_LOG_ERROR("recv failed (bytes_recv=%zu, size_to_recv=%zu, %s)\\n",
                           bytes_recv, size_to_recv, errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : "error");
            mark_failed();
            return false;
        }
        if (n == 0) {
            LOG_DBG("recv returned 0 (peer closed?)\\n");
            mark_failed();
            return false;
        }""", "recv: EINTR retried, a failure or a closed peer marks the socket"),
    _rpc("rpc-transport-broken-timeout", _RPC_TRANSPORT,
"""bool socket_t::recv_data(void * data, size_t size) {
    return pimpl->recv_data(data, size);
}
""",
"""bool socket_t::recv_data(void * data, size_t size) {
    return pimpl->recv_data(data, size);
}

bool socket_t::broken() const {
    return pimpl->failed;
}

static std::atomic<uint32_t> g_rpc_timeout_ms{0};

void rpc_transport_set_timeout_ms(uint32_t ms) {
    g_rpc_timeout_ms = ms;
}
""", "broken() and the timeout setting"),
    _rpc("rpc-transport-connect-timeout", _RPC_TRANSPORT,
"""    if (!set_no_delay(sockfd)) {
        GGML_LOG_ERROR("Failed to set TCP_NODELAY\\n");
        return nullptr;
    }
    struct sockaddr_in addr;""",
"""    if (!set_no_delay(sockfd)) {
        GGML_LOG_ERROR("Failed to set TCP_NODELAY\\n");
        return nullptr;
    }
#ifndef _WIN32
    // kvcache_ggml (build.py): a server that stops answering (stopped, hung, unreachable) fails the call after
    // this long instead of blocking it forever; Linux applies the send timeout to connect() too
    if (uint32_t ms = g_rpc_timeout_ms.load(); ms > 0) {
        struct timeval tv;
        tv.tv_sec = ms / 1000;
        tv.tv_usec = (ms % 1000) * 1000;
        setsockopt(sockfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(sockfd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    }
#endif
    struct sockaddr_in addr;""", "client sockets get the send/receive timeout"),

    _rpc("rpc-client-no-abort", _RPC_CPP,
"""#define RPC_STATUS_ASSERT(x) if (!(x)) GGML_ABORT("Remote RPC server crashed or returned malformed response")
""",
"""// kvcache_ggml (build.py, docs/parity.md): a failed exchange with a server no longer aborts the process. The
// socket is shut down (transport.cpp), the failure is counted, and the call goes on with zeroed answers (a
// stand-in base address, a failed graph compute) so that control returns to the caller, which reads
// ggml_backend_rpc_failure_count() and ggml_backend_rpc_buffer_status() and treats the server's buffers as lost.
#include <atomic>
static std::atomic<uint64_t> g_rpc_failures{0};
static void rpc_client_failed(const char * func) {
    g_rpc_failures++;
    GGML_LOG_ERROR("%s: the RPC server did not answer (it crashed, stopped, timed out or answered wrongly)\\n", func);
}
#define RPC_STATUS_ASSERT(x) if (!(x)) rpc_client_failed(__func__)
""", "RPC client failures count instead of aborting"),
    _rpc("rpc-client-null-socket", _RPC_CPP,
"""static bool send_rpc_cmd(socket_ptr sock, enum rpc_cmd cmd, const void * input, size_t input_size) {
    uint8_t cmd_byte = cmd;
""",
"""static bool send_rpc_cmd(socket_ptr sock, enum rpc_cmd cmd, const void * input, size_t input_size) {
    if (sock == nullptr) {
        return false;  // kvcache_ggml: no connection (get_socket failed)
    }
    uint8_t cmd_byte = cmd;
""", "a missing connection is a failed command, not a NULL dereference"),
    _rpc("rpc-client-zeroed-answer", _RPC_CPP,
"""    if (!send_rpc_cmd(sock, cmd, input, input_size)) {
        return false;
    }
    uint64_t out_size;
    if (!sock->recv_data(&out_size, sizeof(out_size))) {
        return false;
    }
    if (out_size != output_size) {
        return false;
    }
    if (!sock->recv_data(output, output_size)) {
        return false;
    }
    return true;
}""",
"""    uint64_t out_size;
    bool ok = send_rpc_cmd(sock, cmd, input, input_size) && sock->recv_data(&out_size, sizeof(out_size)) &&
              out_size == output_size && sock->recv_data(output, output_size);
    if (!ok && output_size > 0) {
        memset(output, 0, output_size);  // kvcache_ggml: a failed command answers zeros, never stale memory
    }
    return ok;
}""", "a failed command's answer is zeroed"),
    _rpc("rpc-client-sockets-map", _RPC_CPP,
"""static std::shared_ptr<socket_t> get_socket(const std::string & endpoint) {
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    static std::unordered_map<std::string, std::weak_ptr<socket_t>> sockets;

    auto it = sockets.find(endpoint);
    if (it != sockets.end()) {
        if (auto sock = it->second.lock()) {
            return sock;
        }
    }""",
"""// kvcache_ggml: the client's connections by endpoint, at file scope for ggml_backend_rpc_endpoint_status()
static std::mutex g_rpc_sockets_mutex;
static std::unordered_map<std::string, std::weak_ptr<socket_t>> g_rpc_sockets;

static std::shared_ptr<socket_t> get_socket(const std::string & endpoint) {
    std::lock_guard<std::mutex> lock(g_rpc_sockets_mutex);
    auto & sockets = g_rpc_sockets;

    auto it = sockets.find(endpoint);
    if (it != sockets.end()) {
        // kvcache_ggml: a broken connection is returned as long as something made on it lives (new work then fails
        // at once rather than waiting for a stopped server again); once all of it is freed, the next call connects
        if (auto sock = it->second.lock()) {
            return sock;
        }
    }""", "the connections by endpoint at file scope"),
    _rpc("rpc-client-stand-in-base", _RPC_CPP,
"""    bool status = send_rpc_cmd(ctx->sock, RPC_CMD_BUFFER_GET_BASE, &request, sizeof(request), &response, sizeof(response));
    RPC_STATUS_ASSERT(status);
    ctx->base_ptr = reinterpret_cast<void *>(response.base_ptr);""",
"""    bool status = send_rpc_cmd(ctx->sock, RPC_CMD_BUFFER_GET_BASE, &request, sizeof(request), &response, sizeof(response));
    RPC_STATUS_ASSERT(status);
    if (!status) {
        // kvcache_ggml: ggml asserts a non-NULL base; this one is never dereferenced here (remote memory)
        return reinterpret_cast<void *>(uintptr_t(1) << 32);
    }
    ctx->base_ptr = reinterpret_cast<void *>(response.base_ptr);""", "a lost buffer's base is a stand-in"),
    _rpc("rpc-client-alloc-size", _RPC_CPP,
"""        RPC_STATUS_ASSERT(status);

        return response.alloc_size;""",
"""        RPC_STATUS_ASSERT(status);

        return status ? response.alloc_size : ggml_nbytes(tensor);""", "a failed size query gives the plain size"),
    _rpc("rpc-client-buft-failed", _RPC_CPP,
"""    size_t max_size = get_max_size(sock, device);
""",
"""    size_t max_size = get_max_size(sock, device);
    if (alignment == 0 || max_size == 0) {
        return nullptr;  // kvcache_ggml: the server did not answer
    }
""", "no buffer type from a server that did not answer"),
    _rpc("rpc-client-backend-socket", _RPC_CPP,
"""struct ggml_backend_rpc_context {
    std::string endpoint;
    uint32_t    device;
    std::string name;
};""",
"""struct ggml_backend_rpc_context {
    std::string endpoint;
    uint32_t    device;
    std::string name;
    // kvcache_ggml (build.py): the connection this backend computes on, taken when it is made. A server keeps
    // each client connection's buffers apart, so a graph must go where its buffers are: after a failure, new
    // backends and buffers connect again while the lost ones stay on the broken connection and fail at once.
    std::shared_ptr<socket_t> sock;
};""", "a backend computes on the connection it was made on"),
    _rpc("rpc-client-backend-socket-init", _RPC_CPP,
"""        /* .name           = */ dev_name,
    };
    auto reg = ggml_backend_rpc_add_server(endpoint);""",
"""        /* .name           = */ dev_name,
        /* .sock           = */ get_socket(endpoint),
    };
    auto reg = ggml_backend_rpc_add_server(endpoint);""", "a backend takes its connection when made"),
    _rpc("rpc-client-compute-status", _RPC_CPP,
"""    bool reuse = cgraph->uid != 0 && rpc_dev_ctx->last_graph_uid == cgraph->uid;
    if (reuse) {
        rpc_msg_graph_recompute_req request;
        request.device = rpc_ctx->device;
        auto sock = get_socket(rpc_ctx->endpoint);
        bool status = send_rpc_cmd(sock, RPC_CMD_GRAPH_RECOMPUTE, &request, sizeof(request));
        RPC_STATUS_ASSERT(status);
    } else {
        rpc_dev_ctx->last_graph_uid = cgraph->uid;
        std::vector<uint8_t> input;
        serialize_graph(rpc_ctx->device, cgraph, input);
        auto sock = get_socket(rpc_ctx->endpoint);
        bool status = send_rpc_cmd(sock, RPC_CMD_GRAPH_COMPUTE, input.data(), input.size());
        RPC_STATUS_ASSERT(status);
    }
    return GGML_STATUS_SUCCESS;""",
"""    bool reuse = cgraph->uid != 0 && rpc_dev_ctx->last_graph_uid == cgraph->uid;
    bool status;
    if (reuse) {
        rpc_msg_graph_recompute_req request;
        request.device = rpc_ctx->device;
        auto & sock = rpc_ctx->sock;  // kvcache_ggml: its own connection
        status = send_rpc_cmd(sock, RPC_CMD_GRAPH_RECOMPUTE, &request, sizeof(request));
        RPC_STATUS_ASSERT(status);
    } else {
        rpc_dev_ctx->last_graph_uid = cgraph->uid;
        std::vector<uint8_t> input;
        serialize_graph(rpc_ctx->device, cgraph, input);
        auto & sock = rpc_ctx->sock;  // kvcache_ggml: its own connection
        status = send_rpc_cmd(sock, RPC_CMD_GRAPH_COMPUTE, input.data(), input.size());
        RPC_STATUS_ASSERT(status);
    }
    if (!status) {
        rpc_dev_ctx->last_graph_uid = 0;  // kvcache_ggml: the server may not hold this graph
        return GGML_STATUS_FAILED;
    }
    return GGML_STATUS_SUCCESS;""", "a graph not sent is a failed compute"),
    _rpc("rpc-client-status-api", _RPC_CPP,
"""GGML_BACKEND_DL_IMPL(ggml_backend_rpc_reg)""",
"""// kvcache_ggml (build.py): what a caller reads after a call to learn whether a server was lost

void ggml_backend_rpc_set_timeout_ms(uint32_t ms) {
    rpc_transport_set_timeout_ms(ms);
}

uint64_t ggml_backend_rpc_failure_count(void) {
    return g_rpc_failures.load();
}

int ggml_backend_rpc_buffer_status(ggml_backend_buffer_t buffer) {
    if (buffer == nullptr || !ggml_backend_buffer_is_rpc(buffer)) {
        return -1;
    }
    auto * ctx = (ggml_backend_rpc_buffer_context *) buffer->context;
    return ctx->sock == nullptr || ctx->sock->broken() ? 1 : 0;
}

bool ggml_backend_rpc_buffer_sync(ggml_backend_buffer_t buffer) {
    // a round trip on the buffer's connection: every command sent before it has reached the server
    if (buffer == nullptr || !ggml_backend_buffer_is_rpc(buffer)) {
        return false;
    }
    auto * ctx = (ggml_backend_rpc_buffer_context *) buffer->context;
    rpc_msg_buffer_get_base_req request = {ctx->remote_ptr};
    rpc_msg_buffer_get_base_rsp response;
    bool status = send_rpc_cmd(ctx->sock, RPC_CMD_BUFFER_GET_BASE, &request, sizeof(request), &response, sizeof(response));
    RPC_STATUS_ASSERT(status);
    return status;
}

int ggml_backend_rpc_endpoint_status(const char * endpoint) {
    std::lock_guard<std::mutex> lock(g_rpc_sockets_mutex);
    auto it = g_rpc_sockets.find(endpoint);
    if (it == g_rpc_sockets.end()) {
        return -1;
    }
    auto sock = it->second.lock();
    return sock == nullptr ? -1 : sock->broken() ? 1 : 0;
}

GGML_BACKEND_DL_IMPL(ggml_backend_rpc_reg)""", "the failure count, buffer and endpoint status, the timeout setter"),
    _rpc("rpc-client-status-decls", _RPC_H,
"""GGML_BACKEND_API ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
""",
"""GGML_BACKEND_API ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);

// kvcache_ggml (build.py): the client's failures, instead of aborting the process
// send/receive timeout of connections made from now on (0: none)
GGML_BACKEND_API void     ggml_backend_rpc_set_timeout_ms(uint32_t ms);
// failed exchanges with any server since the process started
GGML_BACKEND_API uint64_t ggml_backend_rpc_failure_count(void);
// -1: not an RPC buffer; 0: its connection is alive; 1: its connection failed (its data is lost)
GGML_BACKEND_API int      ggml_backend_rpc_buffer_status(ggml_backend_buffer_t buffer);
// a round trip on the buffer's connection (what was sent before has reached the server); false: it failed
GGML_BACKEND_API bool     ggml_backend_rpc_buffer_sync(ggml_backend_buffer_t buffer);
// -1: no connection to endpoint; 0: alive; 1: failed
GGML_BACKEND_API int      ggml_backend_rpc_endpoint_status(const char * endpoint);
""", "declarations of the status API"),
)


GGML_PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch(
        name="vulkan-lavapipe-full-descriptor-writes",
        backend="vulkan",
        path="vendor/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        old="""    vk::DescriptorSet& descriptor_set = ctx->descriptor_sets[ctx->descriptor_set_idx++];
    vk::WriteDescriptorSet write_descriptor_set{ descriptor_set, 0, 0, pipeline->parameter_count, vk::DescriptorType::eStorageBuffer, nullptr, descriptor_buffer_infos.begin() };
""",
        new="""    vk::DescriptorSet& descriptor_set = ctx->descriptor_sets[ctx->descriptor_set_idx++];
    // kvcache_ggml (build.py, docs/parity.md): every pipeline shares one layout of MAX_PARAMETER_COUNT bindings and
    // a reused set keeps, past parameter_count, the buffers of its earlier dispatches. Mesa's lavapipe (22.x)
    // touches every binding of a bound set, so a binding naming a since-destroyed buffer (a freed KV cache, a
    // reallocated compute buffer) is a use-after-free that corrupts the heap. On lavapipe, fill every binding:
    // the unused ones repeat the first buffer, which is alive.
    std::array<vk::DescriptorBufferInfo, MAX_PARAMETER_COUNT> kv_all_infos;
    uint32_t kv_n_write = pipeline->parameter_count;
    const vk::DescriptorBufferInfo * kv_infos = descriptor_buffer_infos.begin();
    if (ctx->device->driver_id == vk::DriverId::eMesaLlvmpipe && kv_n_write > 0) {
        for (uint32_t i = 0; i < MAX_PARAMETER_COUNT; i++) {
            kv_all_infos[i] = kv_infos[i < kv_n_write ? i : 0];
        }
        kv_n_write = MAX_PARAMETER_COUNT;
        kv_infos = kv_all_infos.data();
    }
    vk::WriteDescriptorSet write_descriptor_set{ descriptor_set, 0, 0, kv_n_write, vk::DescriptorType::eStorageBuffer, nullptr, kv_infos };
""",
        why="lavapipe reads stale descriptor bindings of destroyed buffers (heap corruption): write them all there"),
    # UBSan (build.py --asan test tests/test_quants.py): "quants.c:3314: left shift of 38342 by 16 places cannot be
    # represented in type 'int'" -- a uint16 sign mask promoted to int and shifted into the sign bit, in the IQ3_S
    # dot product's AVX2 and AVX paths; ggml's IQ2_S kernel beside it already casts to uint32_t first
    *(SourcePatch(
        name=f"cpu-iq3s-sign-shift-{i}",
        backend="cpu",
        path="vendor/ggml/src/ggml-cpu/arch/x86/quants.c",
        old=f"(signs[{i}] << 16)",
        new=f"((uint32_t) signs[{i}] << 16)",
        why="IQ3_S dot product: a signed left shift overflow (undefined behaviour) in the sign masks",
        count=2) for i in (1, 3)),
    *RPC_PATCHES,
)


def patches_digest(backends: tuple[str, ...] | None = None) -> str:
    """sha256 over the patches (those of ``backends`` only, when given): part of the source's and a build's
    identity, so that a changed patch unpacks and rebuilds."""
    h = hashlib.sha256()
    for p in GGML_PATCHES:
        if backends is None or p.backend in backends:
            h.update("\0".join((p.name, p.path, p.old, p.new, str(p.count))).encode())
    return h.hexdigest()


def apply_patches(root: Path) -> None:
    for p in GGML_PATCHES:
        f = root / p.path
        text = f.read_text()
        n = text.count(p.old)
        if n != p.count:
            raise SetupError(f"patch {p.name}: its original text occurs {n} times in {f} (expected {p.count}): the "
                             f"pinned source changed, so the patch must be redone")
        f.write_text(text.replace(p.old, p.new))


def unpack_sdist() -> None:
    marker = SOURCE / ".unpacked"
    if SOURCE.exists():
        shutil.rmtree(SOURCE)
    VENDOR_GGML.mkdir(parents=True, exist_ok=True)
    with tarfile.open(SDIST) as tar:
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(VENDOR_GGML, **extra)
    if not (SOURCE / "CMakeLists.txt").exists():
        raise SetupError(f"unpacking {SDIST.name} did not give {SOURCE.relative_to(ROOT)}/CMakeLists.txt")
    apply_patches(SOURCE)
    if GGML_PATCHES:
        say(f"patched the ggml source: {', '.join(p.name for p in GGML_PATCHES)}")
    marker.write_text(source_stamp() + "\n")


def main_patch_source(rest: list[str]) -> int:
    """``build.py patch-source DIR``: apply GGML_PATCHES to the sdist unpacked at DIR (the GPU check builds its own
    copy) and print the patches' digest, for that build's identity."""
    if len(rest) != 1 or not (Path(rest[0]) / "CMakeLists.txt").is_file():
        raise SetupError(f"patch-source takes one folder, an unpacked ggml-python sdist (got {rest!r})")
    apply_patches(Path(rest[0]))
    print(patches_digest())
    return 0


def source_stamp() -> str:
    return f"{GGML_PYTHON_SHA256} patches {patches_digest()}"


def sources_present() -> bool:
    marker = SOURCE / ".unpacked"
    return marker.exists() and marker.read_text().strip() == source_stamp()


def stage_sources(python: Path | str) -> bool:
    """The unpacked source package (headers for the tests, sources for rebuilds); True when fetched now."""
    if sources_present():
        return False
    fetch_sdist(python)
    unpack_sdist()
    return True


def stage_ggml(stamp: dict, flags: BuildFlags, jobs: int) -> dict:
    venv = flags.venv
    if stamp.get("ggml") == ggml_key(flags) and ggml_libs_present(venv):
        return stamp
    check_toolchain()
    if flags.vulkan:
        check_vulkan_toolchain(flags)
    stage_sources(venv_python(venv))
    # GIT_CEILING_DIRECTORIES: ggml's CMakeLists asks git for its commit; without a ceiling git would find and
    # report this project's repository
    env = dict(os.environ, CMAKE_ARGS=build_cmake_args(flags), CMAKE_BUILD_PARALLEL_LEVEL=str(jobs),
               GIT_CEILING_DIRECTORIES=str(VENDOR))
    log = VENDOR / f"build-{flags.flavour() or 'default'}.log"
    say(f"building ggml-python {GGML_PYTHON_VERSION} ({', '.join(flags.backends())}) with {jobs} job(s), "
        f"CMAKE_ARGS={env['CMAKE_ARGS']!r}; log: {log.relative_to(ROOT)}")
    # a persistent build folder per flag set makes a rebuild with the same flags incremental
    build_dir = VENDOR_GGML / "build" / hashlib.sha256(flags.cmake_args().encode()).hexdigest()[:12]
    run_logged(pip("install", "--no-build-isolation", "--no-deps", "--no-cache-dir", "--force-reinstall",
                   "-v", "-C", f"build-dir={build_dir}", str(SOURCE), python=venv_python(venv)),
               f"build of ggml-python {GGML_PYTHON_VERSION}", env=env, log=log)
    stamp = {**stamp, "ggml": ggml_key(flags)}
    write_stamp(venv, stamp)
    return stamp


def stage_project(venv: Path, stamp: dict, extras: tuple[str, ...]) -> dict:
    """Install the project editable; a no-op when the stamp records the same pyproject and every extra needed."""
    have = installed_extras(stamp)
    if set(extras) <= have:
        return stamp
    key = project_key(tuple(have | set(extras)))  # keep what an earlier command installed
    say(f"installing kvcache_ggml editable with extras [{key['extras']}]")
    run_logged(pip("install", "--no-build-isolation", "-e", f".[{key['extras']}]", python=venv_python(venv)),
               "install of kvcache_ggml")
    stamp = {**stamp, "project": key, "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_stamp(venv, stamp)
    return stamp


FASTCALLS_SRC = ROOT / "kvcache_ggml" / "ggml" / "_fastcalls.py"
FASTCALLS_TABLE = ROOT / "kvcache_ggml" / "ggml" / "_lib.py"


def fastcalls_key(stamp: dict) -> dict:
    return {"ggml": stamp.get("ggml"), "generator": file_sha256(FASTCALLS_SRC),
            "table": file_sha256(FASTCALLS_TABLE)}


def fastcalls_present(venv: Path) -> bool:
    """The compiled module is in the venv's own site-packages (it links that venv's ggml)."""
    return any(venv.glob("lib/python3*/site-packages/_kvcache_ggml_ops.*"))


def stage_fastcalls(venv: Path, stamp: dict, env: dict[str, str] | None = None) -> dict:
    """The compiled wrappers of the graph builders' C calls (cffi's API mode, kvcache_ggml/ggml/_fastcalls.py).
    Optional: when they cannot be built (no cffi, compiler or Python headers) the package calls through ctypes; the
    failure is recorded and not retried until something it depends on changes."""
    key = fastcalls_key(stamp)
    done = stamp.get("fastcalls") or {}
    if done.get("key") == key and (fastcalls_present(venv) or done.get("failed")):
        return stamp
    say("compiling the graph builders' C calls with cffi (kvcache_ggml/ggml/_fastcalls.py)")
    proc = subprocess.run([str(venv_python(venv)), "-c", "from kvcache_ggml.ggml._fastcalls import build; print(build())"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = proc.returncode != 0
    if failed:
        last = proc.stdout.strip().splitlines()[-1:] or ["no output"]
        say(f"warning: the compiled calls were not built ({last[0][:200]}); the package calls ggml through ctypes")
    stamp = {**stamp, "fastcalls": {"key": key, "failed": failed}}
    write_stamp(venv, stamp)
    return stamp


# ---- the GPU check's payload: .carry/ ---------------------------------------------------------------------------

def carry_plan() -> list[str]:
    """File names of .carry/ in install order: the pure-Python wheels (CARRY_WHEELS), then the ggml-python sdist."""
    names = []
    for req in CARRY_WHEELS:
        name, _, version = req.partition("==")
        names.append(f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-py3-none-any.whl")
    return names + [SDIST.name]


def read_manifest(folder: Path = CARRY) -> list[tuple[str, str]]:
    """(sha256, file name) of each line of folder/MANIFEST, in order; [] when there is none."""
    try:
        text = (folder / "MANIFEST").read_text()
    except OSError:
        return []
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        m = re.fullmatch(r"([0-9a-f]{64})  ([\w.+-]+)", line)
        if not m:
            raise SetupError(f"{folder / 'MANIFEST'} line {i} is not '<sha256>  <file name>': {line!r}")
        out.append((m.group(1), m.group(2)))
    return out


def write_manifest(folder: Path, names: list[str]) -> None:
    lines = [f"{file_sha256(folder / n)}  {n}\n" for n in names]
    tmp = folder / "MANIFEST.tmp"
    tmp.write_text("".join(lines))
    tmp.replace(folder / "MANIFEST")


def carry_complete() -> bool:
    """.carry/ holds exactly the planned files, each with the sha256 its MANIFEST gives."""
    plan = carry_plan()
    entries = read_manifest()
    if [n for _, n in entries] != plan or sorted(p.name for p in CARRY.iterdir()) != sorted(plan + ["MANIFEST"]):
        return False
    return all(file_sha256(CARRY / n) == h for h, n in entries)


def stage_carry(python: Path | str) -> bool:
    """Fill .carry/ with the planned files and MANIFEST (downloads with `python -m pip`); True when it did work."""
    if CARRY.is_dir() and carry_complete():
        return False
    plan = carry_plan()
    fetch_sdist(python)
    CARRY.mkdir(exist_ok=True)
    for req, fname in zip(CARRY_WHEELS, plan):
        if (CARRY / fname).exists():
            continue
        dl = CARRY / ".download"
        shutil.rmtree(dl, ignore_errors=True)
        run_logged(pip("download", "--no-deps", "--only-binary=:all:", "--python-version", CARRY_PYTHON, "-d",
                       str(dl), req, python=python), f"download of {req} (Python {CARRY_PYTHON})")
        got = sorted(p.name for p in dl.iterdir())
        if got != [fname]:
            raise SetupError(f"downloading {req} gave {got}, not the pure-Python wheel {fname}: the GPU machine "
                             f"needs wheels that install on its Python {CARRY_PYTHON} without building")
        (dl / fname).replace(CARRY / fname)
        dl.rmdir()
    if not (CARRY / SDIST.name).exists() or file_sha256(CARRY / SDIST.name) != GGML_PYTHON_SHA256:
        shutil.copyfile(SDIST, CARRY / SDIST.name)
    for p in CARRY.iterdir():  # one version of each package: two would stop the whole install
        if p.name not in plan:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    write_manifest(CARRY, plan)
    say(f"filled {CARRY.relative_to(ROOT)}/: {', '.join(plan)}")
    return True


def payload_sizes() -> tuple[int, int]:
    """(bytes of the files that travel with the repository -- tracked and untracked-not-ignored --, bytes of .carry/)."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise SetupError(f"git ls-files failed: {proc.stderr.decode().strip()}")
    tree = 0
    for rel in filter(None, proc.stdout.decode().split("\0")):
        with contextlib.suppress(OSError):
            tree += (ROOT / rel).lstat().st_size
    carried = sum(p.stat().st_size for p in CARRY.iterdir() if p.is_file()) if CARRY.is_dir() else 0
    return tree, carried


def main_carry() -> int:
    """`build.py carry`: fill .carry/ with this Python's pip (no .venv/ needed), then print what travels."""
    did = stage_carry(sys.executable)
    tree, carried = payload_sizes()
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    for h, n in read_manifest():
        say(f"  {n}  {mib((CARRY / n).stat().st_size)}  sha256 {h[:16]}...")
    total = tree + carried
    say(f"{'filled' if did else 'up to date'}: .carry/ {mib(carried)} + repository files {mib(tree)} = "
        f"{mib(total)} of {mib(PAYLOAD_LIMIT)}")
    if total > PAYLOAD_LIMIT:
        raise SetupError(f"the payload is {mib(total)}, over the {mib(PAYLOAD_LIMIT)} a GPU machine takes")
    return 0


# ---- CUDA libraries -----------------------------------------------------------------------------------------

def _cuda_roots() -> list[Path]:
    found = [os.environ.get(v, "") for v in ("CUDA_HOME", "CUDA_PATH", "CUDAToolkit_ROOT")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append(str(Path(nvcc).resolve().parent.parent))
    found.append("/usr/local/cuda")
    roots: list[Path] = []
    for r in filter(None, found):
        p = Path(r).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def _cuda_dirs(roots: list[Path], sub: str) -> list[Path]:
    """root/sub and root/targets/*/sub of every toolkit root (sub: include, lib64, lib)."""
    return [d for r in roots for d in [r / sub, *sorted((r / "targets").glob(f"*/{sub}"))] if d.is_dir()]


def _nvcc_major() -> str:
    out = subprocess.run(["nvcc", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout \
        if shutil.which("nvcc") else ""
    m = re.search(r"release (\d+)\.", out)
    return m.group(1) if m else ""


def _wheel_cublas() -> tuple[Path, Path] | None:
    """(include dir, lib dir) of NVIDIA's cuBLAS wheel on this Python's path (torch installs it), or None."""
    major = _nvcc_major()
    subs = ([f"nvidia/cu{major}"] if major else []) + ["nvidia/cu13", "nvidia/cu12", "nvidia/cublas"]
    for base in dict.fromkeys(Path(p).resolve() for p in sys.path if p and Path(p).is_dir()):
        for sub in subs:
            inc, lib = base / sub / "include", base / sub / "lib"
            if (inc / "cublas_v2.h").exists() and any(lib.glob("libcublas.so.*")):
                return inc, lib
    return None


def _system_libcuda() -> Path | None:
    """The NVIDIA driver's libcuda.so.1 (ld cache, then the usual folders), or None on a machine without one."""
    out = subprocess.run(["ldconfig", "-p"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout \
        if shutil.which("ldconfig") else ""
    m = re.search(r"\blibcuda\.so\.1 \(libc6,x86-64[^)]*\) => (\S+)", out)
    if m:
        return Path(m.group(1))
    for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
              "/usr/lib/wsl/lib"):
        if (Path(d) / "libcuda.so.1").exists():
            return Path(d) / "libcuda.so.1"
    return None


def _link(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)
    return link


def cuda_library_args(links: Path) -> list[str]:
    """CMake arguments that let ggml's CUDA backend find cuBLAS and the driver library where the toolkit lacks them.

    A toolkit assembled from NVIDIA's pip wheels (nvcc and cudart only, as on this project's machines) has neither
    cuBLAS nor the driver's link stub. cuBLAS then comes from the nvidia-cublas wheel on this Python's path (torch
    brings it): unversioned links in `links` for the linker, its folder in the libraries' RUNPATH for the loader.
    The driver: the system's libcuda.so.1, or -- on a machine without a driver -- ggml's CUDA backend without VMM
    (its only user of the driver API). NCCL is off (one GPU; ggml would link any it finds).
    """
    roots = _cuda_roots()
    incs, libs = _cuda_dirs(roots, "include"), _cuda_dirs(roots, "lib64") + _cuda_dirs(roots, "lib")
    args, rpath = ["-DGGML_CUDA_NCCL=OFF"], []
    if not (any((d / "cublas_v2.h").exists() for d in incs) and any((d / "libcublas.so").exists() for d in libs)):
        wheel = _wheel_cublas()
        if wheel is None:
            raise SetupError(f"cuBLAS not found (no cublas_v2.h + libcublas.so in the CUDA toolkit at "
                             f"{', '.join(map(str, roots)) or '?'}, no nvidia-cublas wheel on {sys.executable}'s "
                             f"path): ggml's CUDA backend links it")
        inc, lib = wheel
        for name in ("cublas", "cublasLt"):
            real = sorted(lib.glob(f"lib{name}.so.*"))[0]
            args.append(f"-DCUDA_{name}_LIBRARY={_link(links / f'lib{name}.so', real)}")
        args += [f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]
        rpath.append(str(lib))
    if not any((d / "libcuda.so").exists() for d in libs + [d / "stubs" for d in libs]):
        drv = _system_libcuda()
        args.append(f"-DCUDA_cuda_driver_LIBRARY={_link(links / 'libcuda.so', drv)}" if drv
                    else "-DGGML_CUDA_NO_VMM=ON")
    rpath += [str(d) for d in libs if any(d.glob("libcudart.so.*"))][:1]  # cudart, when no ld cache lists it
    if rpath:
        args.append(f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,{':'.join(rpath)}")
    return args


def build_cmake_args(flags: BuildFlags) -> str:
    """CMAKE_ARGS of a ggml build with these flags on this machine (flags + CUDA library locations)."""
    extra = cuda_library_args(VENDOR / "cuda-links") if flags.cuda else []
    return " ".join([flags.cmake_args(), *extra])


@contextlib.contextmanager
def build_lock():
    """Serialise concurrent build.py runs in one checkout."""
    VENDOR.mkdir(exist_ok=True)
    with open(LOCK, "w") as fh:
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def setup(flags: BuildFlags, jobs: int, extras: tuple[str, ...] = COMMAND_EXTRAS[None]) -> bool:
    """Bring the flavour's venv up to date; return True when anything was done."""
    venv = flags.venv
    with build_lock():
        before = read_stamp(venv)
        stamp = stage_venv(venv, before)
        stamp = stage_ggml(stamp, flags, jobs)
        fetched = stage_sources(venv_python(venv))
        stamp = stage_project(venv, stamp, extras)
        stamp = stage_fastcalls(venv, stamp, flavour_env(flags))
        carried = stage_carry(venv_python(venv))
    return stamp != before or fetched or carried


def summary(venv: Path, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([str(venv_python(venv)), "-m", "kvcache_ggml", "info"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SetupError(f"the installed ggml does not load (python -m kvcache_ggml info exited "
                         f"{proc.returncode}):\n{proc.stdout.strip()}")
    for line in proc.stdout.rstrip().splitlines():
        say(line)


def main(argv: list[str]) -> int:
    args, command, rest = parse_args(argv)
    t0 = time.monotonic()
    try:
        flags = BuildFlags(cuda=args.cuda, cuda_arch=str(args.cuda_arch), metal=args.metal, vulkan=args.vulkan,
                           rpc=args.rpc, vulkan_headers=vulkan_headers_dir(args), avx2=args.avx2, asan=args.asan)
        if command == "carry":
            return main_carry()
        if command == "cmake-args":
            print(build_cmake_args(flags))
            return 0
        if command == "patch-source":
            return main_patch_source(rest)
        did_work = setup(flags, args.jobs, COMMAND_EXTRAS[command])
        if did_work:
            say(f"set-up finished in {time.monotonic() - t0:.1f} s")
        if not args.quiet and (did_work or command is None):
            summary(flags.venv, flavour_env(flags))
    except SetupError as e:
        first, _, details = str(e).partition("\n")
        if details:
            print(details, file=sys.stderr)
        print(f"build.py: error: {first}", file=sys.stderr)
        return 2
    py = str(venv_python(flags.venv))
    if flags.asan and command in ("test", "demo"):
        try:
            env, reports = sanitizer_env()
        except SetupError as e:
            print(f"build.py: error: {e}", file=sys.stderr)
            return 2
        # UBSan writes its reports to the process's stderr (its log_path is not honoured beside ASan) and halts:
        # pytest's default fd capture would swallow them with the dying process, so capture Python's streams only
        capture = [] if any(a == "-s" or a.startswith("--capture") for a in rest) else ["--capture=sys"]
        cmd = ([py, "-m", "pytest", *capture, *rest] if command == "test"
               else [py, "-m", "kvcache_ggml", "demo", *rest])
        return sanitizer_verdict(subprocess.call(cmd, cwd=ROOT, env=env), reports)
    if command == "test":
        return subprocess.call([py, "-m", "pytest", *rest], cwd=ROOT)
    if command == "demo":
        return subprocess.call([py, "-m", "kvcache_ggml", "demo", *rest], cwd=ROOT)
    return 0


# ---- the ASan flavour's runs ----------------------------------------------------------------------------------

ASAN_REPORTS = VENDOR / "sanitizer-reports"  # one file per process that reported (log_path), emptied per run


def sanitizer_env(reports: bool = True) -> tuple[dict[str, str], Path]:
    """The environment of a run in the ASan flavour: the sanitizer runtimes preloaded (Python itself is not built
    with them), ``PYTHONMALLOC=malloc`` so that Python's and ctypes' buffers come from the checked allocator, leak
    detection off (CPython keeps memory to the end by design), and (``reports``) every report written to a file
    under ASAN_REPORTS -- pytest would hide a passing test's stderr, and a report must fail the run whatever the
    test said; else reports go to stderr.  Returns (environment, report folder)."""
    cc = find_tool("CC", ("gcc", "cc", "clang")) or "gcc"
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        out = subprocess.run([cc, f"-print-file-name={name}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True).stdout.strip()
        path = Path(out).resolve() if out else None
        if path is None or not path.is_file():
            raise SetupError(f"{cc} does not know {name} (got {out!r}): install the compiler's sanitizer runtimes "
                             f"(Debian: libasan8, libubsan1)")
        libs.append(str(path))
    asan, ubsan = "detect_leaks=0:abort_on_error=1", "print_stacktrace=1:halt_on_error=1"
    if reports:
        shutil.rmtree(ASAN_REPORTS, ignore_errors=True)
        ASAN_REPORTS.mkdir(parents=True)
        asan += f":log_path={ASAN_REPORTS / 'asan'}"
        ubsan += f":log_path={ASAN_REPORTS / 'ubsan'}"
        say(f"sanitizers preloaded: {', '.join(libs)}; reports go to {ASAN_REPORTS.relative_to(ROOT)}/")
    preload = ":".join(libs + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p])
    env = dict(os.environ, LD_PRELOAD=preload, PYTHONMALLOC="malloc", ASAN_OPTIONS=asan, UBSAN_OPTIONS=ubsan)
    return env, ASAN_REPORTS


def flavour_env(flags: BuildFlags) -> dict[str, str] | None:
    """The environment the flavour's Python needs to import ggml (the ASan flavour's preloads; None: as it is)."""
    return sanitizer_env(reports=False)[0] if flags.asan else None


def sanitizer_verdict(rc: int, reports: Path) -> int:
    """The run's exit status, made non-zero by any sanitizer report (each is printed)."""
    found = sorted(p for p in reports.iterdir() if p.is_file())
    for p in found:
        print(f"---- {p.relative_to(ROOT)}\n{p.read_text(errors='replace')}", file=sys.stderr)
    if found:
        print(f"build.py: error: {len(found)} sanitizer report(s) in {reports.relative_to(ROOT)}/", file=sys.stderr)
        return rc or 1
    say("no ASan report files" + ("" if rc == 0 else f"; the run exited {rc} (a UBSan report halts the process: "
                                                    f"see its output above)"))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
