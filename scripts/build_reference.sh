#!/usr/bin/env bash
# Builds the reference: llama.cpp's own KV cache, runtime and server, from the pinned llama-cpp-python 0.3.17 source
# package (PyPI), with the shims in tests/oracle/ (kv_oracle.cpp, kv_oracle_iswa.cpp, kvoracle.py, make_tiny_llama.py).
# The one copy that the oracle tests and the benchmarks use (they find it through tests/oracle/llama_runner.py).
#
#   bash scripts/build_reference.sh            # the cache and runtime: about 15 minutes the first time on 2 cores
#   bash scripts/build_reference.sh --server   # also llama-server (about 10 minutes more), for benchmarks/bench_serve.py
#
# Output: $ORACLE_DIR (default /tmp/kvoracle): venv/ (llama-cpp-python 0.3.17, gguf 0.19.0, numpy), src/ (the
# unpacked source package), libkvoracle.so, libkvoracle_iswa.so, tiny.gguf, and with --server bin/llama-server.
# Each part is built once; delete it to rebuild. Prints the folder.
set -euo pipefail
here=$(cd "$(dirname "$0")/../tests/oracle" && pwd)
O=${ORACLE_DIR:-/tmp/kvoracle}
server=0
for a in "$@"; do
  case $a in --server) server=1 ;; *) echo "usage: build_reference.sh [--server]" >&2; exit 2 ;; esac
done
mkdir -p "$O"
if ! "$O/venv/bin/python" -c "import llama_cpp, gguf" 2>/dev/null; then
  python3 -m venv "$O/venv"
  "$O/venv/bin/pip" -q install --upgrade pip
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \
    "$O/venv/bin/pip" -q install llama-cpp-python==0.3.17 gguf==0.19.0 numpy
fi
if [ ! -d "$O/src/llama_cpp_python-0.3.17" ]; then
  mkdir -p "$O/src" && "$O/venv/bin/pip" -q download --no-deps --no-binary :all: llama-cpp-python==0.3.17 -d "$O/src"
  tar xzf "$O/src/llama_cpp_python-0.3.17.tar.gz" -C "$O/src"
fi
L=$O/src/llama_cpp_python-0.3.17/vendor/llama.cpp
LIB=$("$O/venv/bin/python" -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))")
shim() {  # shim SOURCE OUT.so
  g++ -O2 -std=c++17 -shared -fPIC -o "$2.tmp" "$1" \
    -I"$L/src" -I"$L/include" -I"$L/ggml/include" -L"$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB"
  mv "$2.tmp" "$2"
}
[ "$O/libkvoracle.so" -nt "$here/kv_oracle.cpp" ] || shim "$here/kv_oracle.cpp" "$O/libkvoracle.so"
[ "$O/libkvoracle_iswa.so" -nt "$here/kv_oracle_iswa.cpp" ] || shim "$here/kv_oracle_iswa.cpp" "$O/libkvoracle_iswa.so"
[ -f "$O/tiny.gguf" ] || "$O/venv/bin/python" "$here/make_tiny_llama.py" "$O/tiny.gguf" >/dev/null
if [ $server = 1 ] && [ ! -x "$O/bin/llama-server" ]; then
  cmake -S "$L" -B "$O/server-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF >/dev/null
  cmake --build "$O/server-build" --target llama-server -j "$(nproc)" >/dev/null
  mkdir -p "$O/bin" && cp "$O/server-build/bin/llama-server" "$O/bin/"
fi
echo "$O"
