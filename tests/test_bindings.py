"""The binding layer against the vendored C headers, the compiled library and hand-computed values."""
from __future__ import annotations

import ctypes
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ggml as ggml_python  # ggml-python's own (unmodified) declarations, to test the checker against
import numpy as np
import pytest

from kvcache_ggml import ggml as G

from helpers import UNDER_ASAN, rss_bytes

ROOT = Path(__file__).resolve().parents[1]
POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)
WRONG_IN_GGML_PYTHON = ("ggml_backend_cpu_buffer_type", "ggml_backend_alloc_buffer",
                        "ggml_backend_cpu_buffer_from_ptr", "ggml_backend_sched_get_tensor_backend",
                        "ggml_backend_vk_buffer_type", "ggml_backend_vk_host_buffer_type")
VULKAN_ONLY = ("ggml_backend_vk_buffer_type", "ggml_backend_vk_host_buffer_type")


# ---- the C headers ------------------------------------------------------------------------------------------

def include_dir() -> Path:
    found = sorted(ROOT.glob("vendor/ggml/ggml_python-*/vendor/ggml/include"))
    if not found or not (found[-1] / "ggml.h").exists():
        pytest.fail("no vendored ggml headers under vendor/ggml/ggml_python-*/vendor/ggml/include: "
                    "run `python3 build.py`")
    return found[-1]


class Headers:
    """Prototypes, pointer typedefs and enums of ggml's public headers."""

    def __init__(self, inc: Path) -> None:
        text = "\n".join(p.read_text() for p in sorted(inc.glob("*.h")))
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        text = re.sub(r"//[^\n]*", " ", text)
        self.defines = dict(re.findall(r"^\s*#\s*define\s+(\w+)\s+(-?\w+)\s*$", text, flags=re.M))
        self.text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
        t = self.text
        self.pointer_typedefs = set(re.findall(r"typedef\s+(?:const\s+)?(?:struct\s+)?\w+\s*\*\s*(\w+)\s*;", t))
        self.pointer_typedefs |= set(re.findall(r"typedef[^;{}]*?\(\s*\*\s*(\w+)\s*\)\s*\(", t))
        self.enums: dict[str, dict[str, int]] = {}
        for name, body in re.findall(r"enum\s+(\w+)\s*\{(.*?)\}", t, flags=re.S):
            values, nxt = {}, 0
            for item in filter(None, (s.strip() for s in body.split(","))):
                k, _, v = item.partition("=")
                k, v = k.strip(), v.strip()
                if v:
                    nxt = values[v] if v in values else self._constant(self.defines.get(v, v))
                values[k] = nxt
                nxt = None if nxt is None else nxt + 1
            self.enums[name] = values

    @staticmethod
    def _constant(expr: str) -> int | None:
        # integer literals and shifts/ors of them, e.g. (1 << 8); None for anything else
        if not re.fullmatch(r"[\s()0-9a-fA-FxXuUlL<|+-]*", expr):
            return None
        try:
            return int(eval(re.sub(r"(?<=[0-9a-fA-F])[uUlL]+", "", expr), {"__builtins__": {}}))
        except (SyntaxError, ValueError, TypeError):
            return None

    def prototype(self, name: str) -> tuple[str, list[str], bool]:
        """(return type, parameter declarations, variadic) of function name."""
        m = re.search(r"(?:GGML_API|GGML_BACKEND_API)\s+([^;{}()]*?)\b" + name + r"\s*\(", self.text)
        if not m:
            raise LookupError(f"no prototype of {name} in the headers")
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(self.text[i], 0)
            i += 1
        params = [p.strip() for p in self.text[m.end():i - 1].split(",")]
        params = [] if params in ([""], ["void"]) else params
        variadic = bool(params) and params[-1] == "..."
        return " ".join(m.group(1).split()), params[:-1] if variadic else params, variadic


INT_TYPES = {"int": ctypes.c_int, "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16,
             "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32,
             "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
             "char": ctypes.c_char}
POINTER_CTYPES = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p, ctypes._Pointer, ctypes._CFuncPtr)


def classify(decl: str, h: Headers, is_return: bool) -> tuple[str, str]:
    """('pointer'|'int'|'enum'|'bool'|'float'|'double'|'struct'|'void', C type name) of a declaration."""
    if "*" in decl:
        return "pointer", decl
    words = [w for w in re.findall(r"\w+", decl) if w not in ("const", "GGML_RESTRICT", "restrict")]
    if words[0] in ("struct", "enum"):
        return ("struct" if words[0] == "struct" else "enum"), words[1]
    ctype = words[0]
    if ctype in h.pointer_typedefs:
        return "pointer", ctype
    if ctype == "void" and is_return:
        return "void", ctype
    if ctype in INT_TYPES:
        return "int", ctype
    if ctype in ("bool", "float", "double"):
        return ctype, ctype
    if ctype in h.enums:
        return "enum", ctype
    return "unknown", ctype


def check_type(kind: str, cname: str, t: object) -> str | None:
    """Why ctypes type t cannot carry the C type, or None when it can."""
    if not G.is_ctypes_type(t):
        return f"{t!r} is not a ctypes type (ctypes would read a C int)"
    if kind == "void":
        return None if t is None else f"{t!r} for void"
    if t is None:
        return f"None (void) for {cname}"
    if kind == "pointer":
        if not issubclass(t, POINTER_CTYPES) or ctypes.sizeof(t) != POINTER_SIZE:
            return f"{t.__name__} (size {ctypes.sizeof(t)}) for pointer {cname}"
        return None
    if kind in ("int", "enum"):
        want = INT_TYPES.get(cname, ctypes.c_int)
        if not issubclass(t, ctypes._SimpleCData) or t._type_ not in "bBhHiIlLqQc" \
                or ctypes.sizeof(t) != ctypes.sizeof(want) or t._type_.islower() != want._type_.islower():
            return f"{t.__name__} for {cname} ({ctypes.sizeof(want)}-byte integer, code {want._type_!r})"
        return None
    simple = {"bool": ctypes.c_bool, "float": ctypes.c_float, "double": ctypes.c_double}
    if kind in simple:
        return None if t is simple[kind] else f"{t.__name__} for {cname}"
    if kind == "struct":
        ok = isinstance(t, type) and issubclass(t, ctypes.Structure) and t.__name__ == cname
        return None if ok else f"{t!r} for struct {cname} by value"
    return f"unknown C type {cname}"


def declaration_problems(name: str, fn: object, h: Headers) -> list[str]:
    ret, params, variadic = h.prototype(name)
    problems = []
    kind, cname = classify(ret, h, True)
    why = check_type(kind, cname, fn.restype)
    if why:
        problems.append(f"restype: {why}")
    argtypes = list(fn.argtypes or [])
    if len(argtypes) != len(params):
        problems.append(f"{len(argtypes)} argtypes for {len(params)} parameters{' (+ ...)' if variadic else ''}")
    for i, (p, t) in enumerate(zip(params, argtypes)):
        kind, cname = classify(p, h, False)
        why = check_type(kind, cname, t)
        if why:
            problems.append(f"argument {i} ({p}): {why}")
    return problems


@pytest.fixture(scope="module")
def headers() -> Headers:
    return Headers(include_dir())


def upstream_declaration(name: str) -> SimpleNamespace:
    """ggml-python's declaration of a C function (restype, argtypes), also for a function of a backend that is not
    built: ggml-python then exports a Python stub, and the declaration is read from its decorator in the source."""
    fn = getattr(ggml_python, name)
    if hasattr(fn, "restype"):
        return SimpleNamespace(restype=fn.restype, argtypes=list(fn.argtypes or []))
    from ggml import ggml as decl_module
    source = inspect.getsource(decl_module)
    m = re.search(r'@ggml_function\(\s*"' + name + r'",\s*(\[[^\]]*\]),\s*([\w.]+)\s*[,)]', source)
    assert m, f"no @ggml_function declaration of {name} in ggml-python's source"
    namespace = vars(decl_module)
    return SimpleNamespace(restype=eval(m.group(2), namespace), argtypes=eval(m.group(1), namespace))


def test_header_parser_reads_known_prototypes(headers):
    ret, params, variadic = headers.prototype("ggml_view_4d")
    assert ret == "struct ggml_tensor *" and len(params) == 10 and not variadic
    assert headers.prototype("ggml_backend_cpu_buffer_type") == ("ggml_backend_buffer_type_t", [], False)
    assert headers.prototype("ggml_format_name")[2] is True
    assert classify("ggml_backend_buffer_type_t buft", headers, False) == ("pointer", "ggml_backend_buffer_type_t")
    assert classify("ggml_backend_sched_eval_callback callback", headers, False)[0] == "pointer"
    assert classify("enum ggml_type type", headers, False) == ("enum", "ggml_type")
    assert classify("int64_t ne0", headers, False) == ("int", "int64_t")
    assert classify("struct ggml_init_params params", headers, False) == ("struct", "ggml_init_params")


@pytest.mark.parametrize("name", sorted(G.FUNCTIONS))
def test_table_declaration_matches_header(name, headers):
    assert declaration_problems(name, G.FUNCTIONS[name], headers) == []


@pytest.mark.parametrize("name", WRONG_IN_GGML_PYTHON)
def test_checker_flags_ggml_python_declaration(name, headers):
    upstream = upstream_declaration(name)
    if name in G.FUNCTIONS:
        assert getattr(ggml_python, name) is not G.FUNCTIONS[name]  # ours is a separate function object
    assert not G.is_ctypes_type(upstream.restype)  # ggml-python 0.0.45: a typing.NewType
    problems = declaration_problems(name, upstream, headers)
    assert problems and problems[0].startswith("restype:"), problems


@pytest.mark.parametrize("name", sorted(G.REDECLARED))
def test_redeclarations_match_headers(name, headers):
    """Our declarations, also of functions this build lacks (Vulkan's): what the table would give them."""
    restype, argtypes = G.REDECLARED[name]
    assert declaration_problems(name, SimpleNamespace(restype=restype, argtypes=list(argtypes)), headers) == []


def test_vulkan_functions_are_optional():
    """Declared in the table when libggml-vulkan is built (`build.py --vulkan`), absent otherwise."""
    assert set(VULKAN_ONLY) <= set(G.OPTIONAL)
    for name in VULKAN_ONLY:
        assert G.has(name) == ("ggml-vulkan" in G.LIBRARIES)
        if G.has(name):
            assert G.DEFINED_IN[name] == "ggml-vulkan" and G.FUNCTIONS[name].restype is ctypes.c_void_p


def test_checker_flags_other_wrong_declarations(headers):
    lib = G.LIBRARIES[G.DEFINED_IN["ggml_backend_alloc_buffer"]]
    fn = lib["ggml_backend_alloc_buffer"]  # a fresh function object, declared wrongly below
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32]
    assert declaration_problems("ggml_backend_alloc_buffer", fn, headers) == [
        "restype: c_int (size 4) for pointer ggml_backend_buffer_t",
        "argument 1 (size_t size): c_uint for size_t (8-byte integer, code 'L')"]
    fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    assert declaration_problems("ggml_backend_alloc_buffer", fn, headers) == [
        "3 argtypes for 2 parameters", "argument 1 (size_t size): c_long for size_t (8-byte integer, code 'L')"]


def test_redeclared_is_exactly_what_ggml_python_gets_wrong(headers):
    # every function of the table, built in this ggml or not, but those only build.py's patches add
    names = [n for n in G.REQUIRED + G.OPTIONAL if n not in G.PATCHED]
    wrong = {n for n in names if declaration_problems(n, upstream_declaration(n), headers)}
    assert wrong == set(G.REDECLARED) - set(G.PATCHED)
    assert set(WRONG_IN_GGML_PYTHON) <= wrong


def test_patched_functions_are_declared_as_the_patched_headers_say(headers):
    """build.py's RPC patches add C functions ggml-python knows nothing of: the table declares them itself, as the
    patched ggml-rpc.h does."""
    assert set(G.PATCHED) <= set(G.OPTIONAL) and set(G.PATCHED) <= set(G.REDECLARED)
    for name in G.PATCHED:
        assert not hasattr(ggml_python, name), f"ggml-python now declares {name}: drop it from PATCHED"
        restype, argtypes = G.REDECLARED[name]
        fn = SimpleNamespace(restype=restype, argtypes=list(argtypes))
        assert declaration_problems(name, fn, headers) == [], name
        if G.rpc_available():
            assert G.has(name), f"{name}: the RPC library lacks it (built without build.py's patches?)"


def test_table_functions_are_module_attributes():
    """G.<name> is what the package calls: the compiled wrapper where build.py built one, else the table's ctypes
    function."""
    for name, fn in G.FUNCTIONS.items():
        assert getattr(G, name) is G.CALLS[name] is G.FAST.get(name, fn)
    assert set(G.CALLS) == set(G.FUNCTIONS) and set(G.FAST) <= set(G.FUNCTIONS)
    assert set(G.REQUIRED) <= set(G.FUNCTIONS)
    assert G.DEFINED_IN["ggml_init"] == "ggml-base" and G.DEFINED_IN["ggml_backend_cpu_init"] == "ggml-cpu"


def test_cpu_backend_has_llamafile_sgemm_like_llama_cpp():
    """llama.cpp builds ggml-cpu with llamafile's sgemm; without it the F32/F16/Q8_0 products of several tokens take
    other kernels and plain-attention logits differ from llama.cpp's (docs/exactness.md)."""
    assert G.ggml_cpu_has_llamafile() == 1, "ggml-cpu built without GGML_LLAMAFILE: rerun `python3 build.py`"


# ---- the four re-declared functions, called -----------------------------------------------------------------

def test_cpu_buffer_type_pointer_round_trips():
    buft = G.ggml_backend_cpu_buffer_type()
    assert buft > 0xFFFFFFFF or buft == ctypes.c_uint32(buft).value  # not cut to 32 bits
    assert G.buft_name(buft) == "CPU" and G.ggml_backend_buft_is_host(buft)
    cpu_dev = G.ggml_backend_dev_by_type(G.DeviceType.CPU)
    assert G.ggml_backend_dev_buffer_type(cpu_dev) == buft
    with G.BackendBuffer.alloc(buft, 64) as buf:
        assert buf.buft == buft


def test_alloc_buffer_size_and_type():
    with G.Backend.cpu() as backend, backend.alloc_buffer(1000) as buf:
        assert buf.size == 1000 and buf.name == "CPU" and buf.is_host
        assert buf.buft == G.cpu_buffer_type() == backend.default_buffer_type
        buf.clear(0xAB)
        assert ctypes.string_at(buf.base, 1000) == b"\xab" * 1000


def test_cpu_buffer_from_ptr_uses_the_array_memory():
    arr = G.aligned_zeros(256, np.uint8)
    with G.BackendBuffer.cpu_from_array(arr) as buf:
        assert buf.base == arr.ctypes.data and buf.size == 256 and buf.is_host
        buf.clear(7)
        assert (arr == 7).all()
    with pytest.raises(ValueError, match="aligned"):
        G.BackendBuffer.cpu_from_array(G.aligned_zeros(300, np.uint8)[1:257])


def test_sched_get_tensor_backend_returns_the_backend():
    with G.Backend.cpu() as cpu, G.Context(1 << 20, no_alloc=True) as ctx, G.Sched([cpu], 64) as sched:
        a = ctx.new_tensor("f32", (4,), "a")
        b = G.ggml_scale(ctx.ptr, a, 2.0)
        graph = G.Graph(ctx, 64)
        graph.expand(b)
        sched.alloc_graph(graph)
        G.set_tensor(a, np.arange(4, dtype=np.float32))
        sched.compute(graph)
        assert sched.tensor_backend(b) == cpu.ptr
        np.testing.assert_array_equal(G.to_numpy(b, copy=True), [0, 2, 4, 6])


def test_tensor_and_graph_pointers_cross_as_ints():
    # the table declares struct ggml_tensor * / struct ggml_cgraph * as void *: no ctypes pointer objects
    for name, fn in G.FUNCTIONS.items():
        for t in [fn.restype, *fn.argtypes]:
            assert t not in (G.TensorP, G.CgraphP), f"{name} still declares {t}"
    assert G.FUNCTIONS["ggml_backend_sched_set_eval_callback"].argtypes[1] is G.EvalCallback
    with G.Backend.cpu() as cpu, G.Context(1 << 20, no_alloc=True) as ctx, G.Sched([cpu], 64) as sched:
        a = ctx.new_tensor("f32", (4, 2), "a")
        assert type(a) is int and G.addr(a) == a
        assert ctypes.addressof(G.ggml_tensor.from_address(a)) == a and G.name(a) == "a"
        assert G.FUNCTIONS["ggml_get_tensor"](ctx.ptr, b"a") == a
        assert G.FUNCTIONS["ggml_get_tensor"](ctx.ptr, b"missing") is None and G.addr(None) == 0
        v = G.ggml_view_1d(ctx.ptr, a, 3, 4)
        assert G.view_src(v) == a and G.src(v, 0) == a and G.src(v, 1) is None and G.view_src(a) is None
        b = G.ggml_scale(ctx.ptr, a, 3.0)
        graph = G.Graph(ctx, 64)
        graph.expand(b)
        assert type(graph.ptr) is int and graph.nodes() == [b]
        assert list(ctx.tensors()) == [a, v, b]
        seen = []
        sched.set_eval_callback(lambda t, ask: seen.append((t, ask)) or True)
        sched.alloc_graph(graph)
        G.set_tensor(a, np.arange(8, dtype=np.float32).reshape(2, 4))
        sched.compute(graph)
        assert (b, True) in seen and (b, False) in seen and all(type(t) is int for t, _ in seen)
        np.testing.assert_array_equal(G.to_numpy(b, copy=True), 3 * np.arange(8).reshape(2, 4))


# ---- structs and enums against the C compiler and headers ---------------------------------------------------

C_PROBE = r"""
#include <stdio.h>
#include <stddef.h>
#include "ggml.h"
#define F(s, m) printf(#s "." #m " %zu\n", offsetof(struct s, m))
int main(void) {
    printf("ggml_tensor %zu\n", sizeof(struct ggml_tensor));
    F(ggml_tensor, type); F(ggml_tensor, buffer); F(ggml_tensor, ne); F(ggml_tensor, nb); F(ggml_tensor, op);
    F(ggml_tensor, op_params); F(ggml_tensor, flags); F(ggml_tensor, src); F(ggml_tensor, view_src);
    F(ggml_tensor, view_offs); F(ggml_tensor, data); F(ggml_tensor, name); F(ggml_tensor, extra);
    printf("ggml_init_params %zu\n", sizeof(struct ggml_init_params));
    F(ggml_init_params, mem_size); F(ggml_init_params, mem_buffer); F(ggml_init_params, no_alloc);
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler (gcc/cc) to check struct layouts")
    d = tmp_path_factory.mktemp("cprobe")
    (d / "probe.c").write_text(C_PROBE)
    subprocess.run([cc, "-I", str(include_dir()), "-o", str(d / "probe"), str(d / "probe.c")], check=True)
    out = subprocess.run([str(d / "probe")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_ggml_tensor_layout_matches_c(c_layout):
    assert ctypes.sizeof(G.ggml_tensor) == c_layout["ggml_tensor"] == 336
    for field in ("type", "buffer", "ne", "nb", "op", "op_params", "flags", "src", "view_src", "view_offs", "data",
                  "name", "extra"):
        assert getattr(G.ggml_tensor, field).offset == c_layout[f"ggml_tensor.{field}"], field


def test_ggml_init_params_layout_matches_c(c_layout):
    assert ctypes.sizeof(G.ggml_init_params) == c_layout["ggml_init_params"]
    for field in ("mem_size", "mem_buffer", "no_alloc"):
        assert getattr(G.ggml_init_params, field).offset == c_layout[f"ggml_init_params.{field}"], field


class GgmlObject(ctypes.Structure):
    """struct ggml_object of ggml.c (private): the header ggml puts before each tensor in a context."""
    _fields_ = [("offs", ctypes.c_size_t), ("size", ctypes.c_size_t), ("next", ctypes.c_void_p),
                ("type", ctypes.c_int), ("padding", ctypes.c_char * 4)]


def test_tensor_overhead_is_object_plus_tensor():
    assert G.ggml_tensor_overhead() == ctypes.sizeof(GgmlObject) + ctypes.sizeof(G.ggml_tensor) == 32 + 336


def test_enums_match_headers(headers):
    want_types = {k[len("GGML_TYPE_"):]: v for k, v in headers.enums["ggml_type"].items() if k != "GGML_TYPE_COUNT"}
    got_types = {t.name: t.value for t in G.GGMLType}
    assert got_types == {k: v for k, v in want_types.items() if k.upper() in {n.upper() for n in got_types}}
    assert {k.upper() for k in got_types} == {k.upper() for k in want_types}
    assert headers.enums["ggml_type"]["GGML_TYPE_COUNT"] == G.GGML_TYPE_COUNT
    ops = headers.enums["ggml_op"]
    assert ops["GGML_OP_COUNT"] == G.GGML_OP_COUNT == len(G.GGMLOp)
    assert {f"GGML_OP_{op.name}": op.value for op in G.GGMLOp} == {k: v for k, v in ops.items() if k != "GGML_OP_COUNT"}
    assert {f"GGML_STATUS_{s.name}": s.value for s in G.Status} == headers.enums["ggml_status"]
    assert {f"GGML_BACKEND_DEVICE_TYPE_{s.name}": s.value for s in G.DeviceType} == \
        headers.enums["ggml_backend_dev_type"]
    for mode in ("NORMAL", "NEOX", "MROPE", "VISION", "IMROPE"):
        assert getattr(G, f"GGML_ROPE_TYPE_{mode}") == int(headers.defines[f"GGML_ROPE_TYPE_{mode}"])


# ---- helpers ------------------------------------------------------------------------------------------------

def test_row_size_by_hand():
    assert G.row_size("f32", 10) == 40
    assert G.row_size("f16", 10) == 20
    assert G.row_size("bf16", 3) == 6
    assert G.row_size("q8_0", 64) == 2 * 34  # 32 int8 + one f16 scale per block
    assert G.row_size("q4_0", 32) == 18  # 16 bytes of nibbles + f16 scale
    assert G.row_size("q4_K", 256) == 144
    assert (G.type_size("q8_0"), G.blck_size("q8_0")) == (34, 32)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        G.row_size("q8_0", 33)


def test_type_tables_agree_with_ggml():
    """The per-type tables read at import answer as ggml's own functions, for every type and a few row lengths."""
    for t in G.GGMLType:
        blck = G.ggml_blck_size(int(t))
        assert (G.blck_size(t), G.type_size(t)) == (blck, G.ggml_type_size(int(t)))
        assert G.is_quantized(int(t)) is bool(G.ggml_is_quantized(int(t)))
        for n in (0, blck, 7 * blck, 4096 * blck):
            assert G.row_size(t, n) == G.ggml_row_size(int(t), n)
    for v in (G.GGMLType.Q8_0, 8, True, np.int64(8)):  # members, ints, bools and numpy ints as before
        assert G.parse_type(v) is G.GGMLType(int(v))


def test_type_names_round_trip():
    assert len(G.type_names()) == len(G.GGMLType)
    for t in G.GGMLType:
        assert G.parse_type(G.type_name(t)) is t
        assert G.parse_type(G.type_name(t).upper()) is t
        assert G.parse_type(int(t)) is t
    assert G.type_name("F16") == "f16" and G.type_name(G.GGMLType.Q4_K) == "q4_K"
    assert G.parse_type("Q8_0") == 8 and G.parse_type(" bf16 ") == 30
    assert G.is_quantized("q8_0") and not G.is_quantized("f16")
    with pytest.raises(ValueError, match=r"unknown ggml type name 'f8'; valid names: f32, f16, q4_0"):
        G.parse_type("f8")
    with pytest.raises(ValueError, match="invalid ggml type value 4"):
        G.parse_type(4)  # removed Q4_2 slot


def test_np_shape():
    assert G.np_shape((5, 3, 2, 1)) == (2, 3, 5)
    assert G.np_shape((5, 1, 1, 1)) == (5,)
    assert G.np_shape((1, 1, 1, 1)) == (1,)
    assert G.np_shape((5, 1, 2, 1)) == (2, 1, 5)
    assert G.np_shape((5, 3, 1, 1), ndim=4) == (1, 1, 3, 5)
    with pytest.raises(ValueError):
        G.np_shape((5, 3, 1, 1), ndim=1)
    with pytest.raises(ValueError):
        G.np_shape((5, 3))


def test_tensor_fields_by_hand():
    with G.Context(1 << 16) as ctx:
        t = ctx.new_tensor("f32", (5, 3, 2), "x")
        assert G.ne(t) == (5, 3, 2, 1)
        assert G.nb(t) == (4, 20, 60, 120)
        assert G.ttype(t) is G.GGMLType.F32 and G.name(t) == "x"
        assert G.nbytes(t) == 120 and G.nelements(t) == 30 and G.is_contiguous(t)
        assert G.op(t) is G.GGMLOp.NONE and G.src(t, 0) is None and G.buffer(t) == 0 and G.data_ptr(t) != 0
        q = ctx.new_tensor("q8_0", (64, 3))
        assert G.nb(q) == (34, 68, 204, 204)
        v = G.ggml_view_2d(ctx.ptr, t, 2, 3, G.nb(t)[1], 4)  # columns 1..2 of each row
        assert G.view_offs(v) == 4 and G.addr(G.view_src(v)) == G.addr(t)
        assert G.op(v) is G.GGMLOp.VIEW and G.addr(G.src(v, 0)) == G.addr(t)
        assert G.data_ptr(v) == G.data_ptr(t) + 4
        G.set_name(v, "v" * 63)
        with pytest.raises(ValueError, match="at most 63"):
            G.set_name(v, "v" * 64)
        with pytest.raises(ValueError, match="source index 10"):
            G.src(v, 10)


def test_node_namer_writes_what_ggml_set_name_writes():
    with G.Context(1 << 16, no_alloc=True) as ctx, G.Context(1 << 16, no_alloc=True) as other:
        cb = ctx.node_namer()
        a, b, c = (ctx.new_tensor("f32", (4,)) for _ in range(3))
        for t in (a, b, c):  # a long name first: both ways leave its tail after the new name's NUL
            G.ggml_set_name(t, b"x" * 40)
        G.ggml_set_name(a, b"Qcur-11")
        G.ggml_set_name(c, b"result_norm")
        assert cb(b, "Qcur", 11) == b
        field = lambda t: ctypes.string_at(t + G.ggml_tensor.name.offset, G.GGML_MAX_NAME)  # noqa: E731 (char[64])
        assert field(a) == field(b) == b"Qcur-11\0" + b"x" * 32 + b"\0" * 24
        cb(a, "result_norm")  # no layer: the name alone
        assert field(a) == field(c) and G.name(a) == "result_norm" and G.name(b) == "Qcur-11"
        cb(b, "n" * (G.GGML_MAX_NAME - 4), 10)
        assert G.name(b) == "n" * (G.GGML_MAX_NAME - 4) + "-10"
        with pytest.raises(ValueError, match="ggml keeps at most 63"):
            cb(b, "n" * (G.GGML_MAX_NAME - 3), 10)
        assert G.name(b) == "n" * (G.GGML_MAX_NAME - 4) + "-10"
        with pytest.raises(ValueError, match="not in this context's pool"):
            cb(other.new_tensor("f32", (4,)), "c")
        with pytest.raises(ValueError, match="not in this context.s pool"):  # past the pool end
            cb(ctx.ptr + ctx.mem_size - 8 - G.ggml_tensor.name.offset, "abcdefghijklmnop")
    with pytest.raises(ValueError, match="released"):
        cb(a, "a")


def test_host_flat_is_a_flat_live_view():
    """host_flat: the elements of a dense host tensor in memory order, written through; None without elements or
    data; quantized and strided tensors as to_numpy gives them, flattened."""
    with G.Context(1 << 16) as ctx:
        for dtype in (np.float32, np.float16, np.int32, np.int64):
            a = np.arange(30).astype(dtype).reshape(2, 3, 5)
            t = G.from_numpy(ctx, a)
            flat = G.host_flat(t)
            assert flat.shape == (30,) and flat.dtype == dtype
            np.testing.assert_array_equal(flat, a.reshape(-1))
            flat[7] = 3
            assert G.to_numpy(t)[0, 1, 2] == 3
        assert G.host_flat(ctx.new_tensor("f32", (0, 4))) is None
        q = ctx.new_tensor("q8_0", (64, 3))
        np.testing.assert_array_equal(G.host_flat(q), G.to_numpy(q).reshape(-1))
        t = G.from_numpy(ctx, np.arange(15, dtype=np.float32).reshape(3, 5))
        v = G.ggml_view_2d(ctx.ptr, t, 2, 3, G.nb(t)[1], 4)  # columns 1..2 of each row
        np.testing.assert_array_equal(G.host_flat(v), np.arange(15).reshape(3, 5)[:, 1:3].reshape(-1))
    with G.Context(1 << 16, no_alloc=True) as ctx:
        assert G.host_flat(ctx.new_tensor("f32", (4,))) is None  # no data yet


def test_to_numpy_views_and_copies():
    with G.Context(1 << 16) as ctx:
        a = np.arange(30, dtype=np.float32).reshape(2, 3, 5)
        t = G.from_numpy(ctx, a, "a")
        assert G.ne(t) == (5, 3, 2, 1)
        view = G.to_numpy(t)
        np.testing.assert_array_equal(view, a)
        view[1, 2, 4] = -1.0  # a view: the tensor's memory changes
        assert G.to_numpy(t, copy=True)[1, 2, 4] == -1.0
        copy = G.to_numpy(t, copy=True)
        copy[0, 0, 0] = 99.0
        assert G.to_numpy(t)[0, 0, 0] == 0.0
        v = G.ggml_view_2d(ctx.ptr, t, 2, 3, G.nb(t)[1], 4)  # non-contiguous view: a[0, :, 1:3]
        np.testing.assert_array_equal(G.to_numpy(v), a[0, :, 1:3])
        assert G.to_numpy(t, ndim=4).shape == (1, 2, 3, 5)
        q = ctx.new_tensor("q8_0", (64, 3))
        qa = G.to_numpy(q)
        assert qa.shape == (3, 68) and qa.dtype == np.uint8
        h = G.from_numpy(ctx, np.array([1.5, -2.0], np.float16))
        assert G.ttype(h) is G.GGMLType.F16 and G.to_numpy(h).tolist() == [1.5, -2.0]


def test_get_into_copies_whole_tensors_into_a_given_array():
    with G.Context.for_tensors(2) as ctx:
        t = ctx.new_tensor("f32", (5, 3))
        with G.BackendBuffer.for_context(ctx, G.cpu_buffer_type()):
            want = np.random.default_rng(3).standard_normal((3, 5)).astype(np.float32)
            G.set_tensor(t, want)
            out = np.full((4, 5), -7.0, np.float32)
            G.get_into(t, out[1:4])                      # rows of a larger array: no allocation
            np.testing.assert_array_equal(out[1:4], want)
            assert (out[0] == -7.0).all()                # nothing written outside the rows given
            with pytest.raises(ValueError, match="60 bytes"):
                G.get_into(t, np.zeros((2, 5), np.float32))
            with pytest.raises(ValueError, match="not contiguous"):
                G.get_into(t, np.zeros((3, 10), np.float32)[:, ::2])
            v = G.ggml_view_2d(ctx.ptr, t, 2, 3, G.nb(t)[1], 4)
            with pytest.raises(ValueError, match="is not contiguous"):
                G.get_into(v, np.zeros((3, 2), np.float32))


def test_native_call_counter_counts_and_restores():
    from native_calls import NativeCalls
    before = dict(G.CALLS)
    with G.Context(1 << 12) as ctx:
        t = G.from_numpy(ctx, np.zeros((2, 3), np.float32))
        with NativeCalls() as nc:
            assert G.nelements(t) == 6 and G.ne(t) == (3, 2, 1, 1)
            G.ggml_nbytes(t)
        assert dict(nc.calls) == {"ggml_nelements": 1, "ggml_nbytes": 1} and nc.struct_reads == 1
    assert G.CALLS == before and all(getattr(G, k) is v for k, v in before.items())


def test_advise_huge_pages_keeps_the_data_and_covers_the_aligned_interior():
    huge = 2 << 20
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp_on = sys.platform.startswith("linux") and thp.exists() and "[never]" not in thp.read_text()
    with G.Context.for_tensors(1) as ctx:
        t = ctx.new_tensor("f32", (3 * huge // 4 + 1000,))
        with G.BackendBuffer.for_context(ctx, G.cpu_buffer_type()) as buf:
            data = np.random.default_rng(4).standard_normal(G.ne(t)[0]).astype(np.float32)
            G.set_tensor(t, data)
            got = buf.advise_huge_pages()
            interior = (buf.base + buf.size) // huge * huge - -(-buf.base // huge) * huge
            assert got == (interior if thp_on else 0)
            assert buf.in_cpu_memory and interior >= huge
            np.testing.assert_array_equal(G.to_numpy(t, copy=True), data)


def test_set_tensor_through_a_backend_buffer():
    with G.Context.for_tensors(2) as ctx:
        t = ctx.new_tensor("i32", (4, 2))
        u = ctx.new_tensor("f16", (3,))
        with pytest.raises(ValueError, match="no data"):
            G.set_tensor(t, np.zeros((2, 4), np.int32))
        with G.BackendBuffer.for_context(ctx, G.cpu_buffer_type()) as buf:
            assert buf.size >= 32 + 6 and G.buffer(t) == buf.ptr
            G.set_tensor(t, np.arange(8).reshape(2, 4))  # int64 -> int32, same kind
            np.testing.assert_array_equal(G.to_numpy(t, copy=True), np.arange(8).reshape(2, 4))
            G.set_tensor(u, [0.5, 1.0, 2.0])
            assert G.to_numpy(u).tolist() == [0.5, 1.0, 2.0]
            with pytest.raises(ValueError, match="does not fit"):
                G.set_tensor(t, np.zeros((4, 2), np.int32))
            with pytest.raises(ValueError, match="cannot store float64"):
                G.set_tensor(t, np.zeros((2, 4)))
            with pytest.raises(ValueError, match="no_alloc"):
                G.from_numpy(ctx, np.zeros(3, np.float32))


def test_context_refuses_tensors_it_cannot_hold():
    overhead = G.ggml_tensor_overhead()
    with G.Context(2 * overhead, no_alloc=True) as ctx:
        ctx.new_tensor("f32", (1000,))
        ctx.new_tensor("f32", (1000,))
        with pytest.raises(MemoryError, match="context has 0 bytes free"):
            ctx.new_tensor("f32", (1,))  # ggml itself would abort the process
        assert len(list(ctx.tensors())) == 2
    with G.Context(overhead + 64) as ctx:  # allocating: 64 bytes of data fit, 80 do not
        ctx.new_tensor("f32", (16,))
    with G.Context(overhead + 64) as ctx, pytest.raises(MemoryError):
        ctx.new_tensor("f32", (20,))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.skipif(UNDER_ASAN, reason="ASan's quarantine keeps freed memory resident (to catch uses after free)")
def test_owners_close_once_and_free_memory():
    big = 256 << 20
    before = rss_bytes()
    buf = G.BackendBuffer.alloc(G.cpu_buffer_type(), big)
    buf.clear(1)  # touch every page
    assert rss_bytes() - before > big * 0.9
    buf.close()
    assert rss_bytes() - before < big * 0.1
    buf.close()  # idempotent
    assert buf.closed
    with pytest.raises(ValueError, match="closed"):
        _ = buf.ptr
    with G.Context(big) as ctx:
        t = ctx.new_tensor("i8", (big - 4096,))
        G.to_numpy(t)[:] = 1
        assert rss_bytes() - before > big * 0.9
    assert ctx.closed and rss_bytes() - before < big * 0.1
    buf2 = G.BackendBuffer.alloc(G.cpu_buffer_type(), big)
    buf2.clear(1)
    del buf2  # the __del__ safety net frees it
    assert rss_bytes() - before < big * 0.1
    backend = G.Backend.cpu(2)
    assert backend.name == "CPU" and backend.is_cpu
    backend.close()
    backend.close()
    assert repr(backend) == "<Backend closed>"


def test_compute_on_cpu_backend_matches_numpy():
    with G.Context.for_tensors(4) as ctx, G.Context.for_tensors(0, 16) as gctx, G.Backend.cpu(1) as be:
        cache = ctx.new_tensor("f16", (4, 5))
        cur = ctx.new_tensor("f32", (4, 2))
        idx = ctx.new_tensor("i64", (2,))
        out = G.ggml_set_rows(ctx.ptr, cache, cur, idx)
        with G.BackendBuffer.for_context(ctx, G.cpu_buffer_type()):
            G.set_tensor(cache, np.zeros((5, 4), np.float16))
            G.set_tensor(cur, [[1, 2, 3, 4], [5, 6, 7, 8]])
            G.set_tensor(idx, [3, 1])
            graph = G.Graph(gctx, 16)
            graph.expand(out)
            be.compute(graph)
            assert [G.op_name(G.op(n)) for n in graph.nodes()] == ["SET_ROWS"]
            want = np.zeros((5, 4), np.float16)
            want[[3, 1]] = [[1, 2, 3, 4], [5, 6, 7, 8]]
            np.testing.assert_array_equal(G.to_numpy(cache), want)


def test_dequantize_q8_0_by_hand():
    # q8_0 block of 32: an f16 scale d, then 32 int8 q; value = d * q.  Rows [2, 3] of 2 blocks each
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, size=(2, 3, 2, 32)).astype(np.int8)
    d = rng.uniform(0.01, 1.0, size=(2, 3, 2, 1)).astype(np.float16)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=3).reshape(2, 3, 2 * 34)
    got = G.dequantize(raw, G.GGMLType.Q8_0)
    assert got.dtype == np.float32 and got.shape == (2, 3, 64)
    np.testing.assert_array_equal(got, (d.astype(np.float32) * q).reshape(2, 3, 64))


def test_devices_and_registries():
    assert G.version() == "0.15.3" and G.GGML_PYTHON_VERSION == "0.0.45"
    devs = G.devices()
    cpu = [d for d in devs if d.type is G.DeviceType.CPU]
    assert len(cpu) == 1 and cpu[0].name == "CPU" and cpu[0].registry == "CPU"
    assert cpu[0].memory_total > 0 and 0 < cpu[0].memory_free <= cpu[0].memory_total
    assert G.device("CPU").ptr == cpu[0].ptr
    assert "CPU" in G.registries()
    assert G.rpc_available() == ("RPC" in G.registries()) == ("ggml-rpc" in G.LIBRARIES)
    with pytest.raises(ValueError, match="no ggml device named 'NOPE'"):
        G.device("NOPE")
