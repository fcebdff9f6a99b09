#!/usr/bin/env bash
# Builds the iSWA oracle shim (kv_oracle_iswa.cpp next to this file) against the shared oracle's llama.cpp, the way
# ../../../shared/oracle/build.sh builds kv_oracle.cpp: usage build_iswa.sh OUT.so  (ORACLE_DIR default /tmp/kvoracle)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
O=${ORACLE_DIR:-/tmp/kvoracle}
out=${1:?usage: build_iswa.sh OUT.so}
L=$O/src/llama_cpp_python-0.3.17/vendor/llama.cpp
LIB=$("$O/venv/bin/python" -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))")
g++ -O2 -std=c++17 -shared -fPIC -o "$out.tmp" "$here/kv_oracle_iswa.cpp" \
  -I"$L/src" -I"$L/include" -I"$L/ggml/include" -L"$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB"
mv "$out.tmp" "$out"
echo "$out"
