"""cffi's API mode for the C calls of graph building: a compiled module of thin C wrappers, one per function.

A ctypes call costs about 0.3 µs more per argument than a compiled call (libffi prepares each call from the
``argtypes`` at run time); a graph build makes one call per node, with up to thirteen arguments (``ggml_rope_ext``),
about 140 for the tiny test model's graph and 420 for a 12-layer one.  ``build_module`` compiles, with cffi's API
mode against ggml's own headers (the vendored ggml-python source package), one C function ``kv_<name>`` per name of
``NAMES``, generated from the table's ctypes declaration of ``<name>`` (``_lib.FUNCTIONS``, checked against the
headers by tests/test_bindings.py; the compiler checks each call against the header's prototype again):

* a pointer (``void *`` in the table: tensors, contexts, graphs, the scheduler) crosses as ``intptr_t``: a Python int,
  as the binding layer's handles are; NULL is 0 (pass ``G.addr(t)`` where a tensor may be None);
* scalars keep their C types (``int``, ``int64_t``, ``size_t``, ``float``, ``bool``); a string argument is
  ``const char *`` (bytes).

Only functions that never return NULL are in ``NAMES`` (op constructors, which assert instead, and functions
returning ``void`` or a number), so a returned 0 never stands for the ctypes table's None.

``build.py`` builds the module once per set-up (:func:`build`); it is optional:
without cffi, a C compiler or Python's headers the binding layer keeps the ctypes functions.  The module records the
declarations it was generated from (``kv_signature()``); :func:`load` uses it only when they are the table's
current ones.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["NAMES", "MODULE", "build", "build_module", "c_source", "load", "signature"]

# the compiled module: top level, in the site-packages of the venv whose ggml it links (each build.py flavour has
# its venv, so a Vulkan or ASan venv never loads wrappers linked against another venv's libggml)
MODULE = "_kvcache_ggml_ops"

# the graph builders' calls (graph.py, gemma.py, the cache's views, stores, shifts and masks) and the step's compute
NAMES: tuple[str, ...] = (
    "ggml_new_tensor_1d", "ggml_new_tensor_2d", "ggml_new_tensor_3d", "ggml_new_tensor_4d", "ggml_dup_tensor",
    "ggml_view_tensor", "ggml_view_1d", "ggml_view_2d", "ggml_view_3d", "ggml_view_4d",
    "ggml_reshape_1d", "ggml_reshape_2d", "ggml_reshape_3d", "ggml_reshape_4d", "ggml_permute", "ggml_transpose",
    "ggml_cont", "ggml_cont_2d", "ggml_cont_3d", "ggml_set_rows", "ggml_get_rows", "ggml_pad", "ggml_cast",
    "ggml_cpy", "ggml_rope_ext", "ggml_rope_ext_inplace", "ggml_add", "ggml_mul", "ggml_scale", "ggml_mul_mat",
    "ggml_soft_max_ext", "ggml_rms_norm", "ggml_swiglu_split", "ggml_geglu_split", "ggml_tanh",
    "ggml_flash_attn_ext", "ggml_flash_attn_ext_set_prec", "ggml_mul_mat_set_prec",
    "ggml_set_input", "ggml_set_output", "ggml_set_name", "ggml_build_forward_expand", "ggml_graph_n_nodes",
    "ggml_new_graph_custom", "ggml_graph_overhead_custom", "ggml_tensor_overhead", "ggml_reset",
    "ggml_get_no_alloc", "ggml_get_mem_size", "ggml_used_mem",
    "ggml_backend_sched_graph_compute",
)
_HEADERS = ("ggml.h", "ggml-backend.h")


def _c_type(t: Any, result: bool = False) -> str:
    """The C type a ctypes declaration stands for, as the wrappers declare it (``result``: of the returned value);
    ValueError for others."""
    if t is None:
        return "void"
    if t is ctypes.c_void_p:
        return "intptr_t"
    if t is ctypes.c_bool:
        return "bool"
    if t is ctypes.c_char_p and not result:  # (an argument: bytes; ctypes returns a string as bytes, cffi not)
        return "const char *"
    if t is ctypes.c_float:
        return "float"
    if t is ctypes.c_double:
        return "double"
    if isinstance(t, type) and issubclass(t, ctypes._SimpleCData) and t._type_ in "bBhHiIlLqQ":
        signed = t._type_.islower()
        return f"{'' if signed else 'u'}int{8 * ctypes.sizeof(t)}_t"
    raise ValueError(f"no fast-call C type for the ctypes type {t!r}")


def _declarations(functions: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(name, C return type, C argument types) of each name of NAMES the table holds."""
    out = []
    for name in NAMES:
        fn = functions.get(name)
        if fn is not None:
            out.append((name, _c_type(fn.restype, True), [_c_type(a) for a in fn.argtypes]))
    return out


def signature(functions: dict[str, Any]) -> str:
    """A digest of the declarations the module is generated from."""
    text = ";".join(f"{r} {n}({','.join(a)})" for n, r, a in _declarations(functions))
    return hashlib.sha256(text.encode()).hexdigest()


def c_source(functions: dict[str, Any]) -> tuple[str, str]:
    """(cdef, C source) of the wrappers of ``functions`` (name -> ctypes function, the table)."""
    cdef, src = ["const char * kv_signature(void);"], [f'#include "{h}"' for h in _HEADERS]
    src += ["#include <stdbool.h>", "#include <stdint.h>",
            f'static const char * kv_signature(void) {{ return "{signature(functions)}"; }}']
    for name, ret, args in _declarations(functions):
        params = ", ".join(f"{a} a{i}" for i, a in enumerate(args)) or "void"
        call = ", ".join(f"(void *) a{i}" if a == "intptr_t" else f"a{i}" for i, a in enumerate(args))
        body = f"{name}({call})"
        body = "return (intptr_t) " + body if ret == "intptr_t" else ("" if ret == "void" else "return ") + body
        cdef.append(f"{ret} kv_{name}({params});")
        src.append(f"static {ret} kv_{name}({params}) {{ {body}; }}")
    return "\n".join(cdef), "\n".join(src)


def _include_dir() -> Path:
    root = Path(__file__).resolve().parents[2]
    found = sorted(root.glob("vendor/ggml/ggml_python-*/vendor/ggml/include"))
    if not found:
        raise FileNotFoundError(f"no ggml headers under {root / 'vendor'}: run python3 build.py first")
    return found[-1]


def build_module(functions: dict[str, Any], lib_dir: Path, dest_dir: Path) -> Path:
    """Compile the module into ``dest_dir``; its path.  cffi and a C compiler are needed."""
    import cffi

    ffi = cffi.FFI()
    cdef, src = c_source(functions)
    ffi.cdef(cdef)
    ffi.set_source(MODULE, src, include_dirs=[str(_include_dir())], library_dirs=[str(lib_dir)],
                   libraries=["ggml-base", "ggml"], extra_link_args=[f"-Wl,-rpath,{lib_dir}"])
    with tempfile.TemporaryDirectory(prefix="kv_fastcalls_") as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        dest = dest_dir / built.name
        shutil.copyfile(built, dest.with_suffix(".tmp"))
        dest.with_suffix(".tmp").replace(dest)
    return dest


def load(functions: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(name -> compiled function, for every name of NAMES in ``functions``; why not, when that is empty)."""
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:  # not built (or cffi's backend missing): the ctypes table serves
        return {}, f"{MODULE} is not built ({e})"
    lib, ffi = mod.lib, mod.ffi
    built = ffi.string(lib.kv_signature()).decode()
    if built != signature(functions):
        return {}, f"{MODULE} was built from other declarations: rebuild it (python3 build.py)"
    return {name: getattr(lib, f"kv_{name}") for name, _, _ in _declarations(functions)}, ""


def build() -> Path:
    """Build the module for the table of this installation into this interpreter's site-packages (what
    ``build.py`` runs); its path."""
    import sysconfig

    from ._lib import FUNCTIONS, LIB_DIR
    return build_module(FUNCTIONS, LIB_DIR, Path(sysconfig.get_paths()["platlib"]))
