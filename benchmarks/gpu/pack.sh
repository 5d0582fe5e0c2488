#!/usr/bin/env bash
# Prepare what benchmarks/gpu/run.sh needs on a CUDA machine without network, into benchmarks/gpu/payload/
# (git-ignored; carried to the machine, 64 MiB at most):
#   - the pinned llama-cpp-python sdist stripped of what a CUDA build does not read (its .git, models, docs, web
#     UI, tests, other GPU backends);
#   - wheels (pure Python) for its build backend and the bench's imports: pip cannot reach PyPI there;
#   - a trained pair from a finished run: its GGUFs, held-out prompts, acceptance.json (each draft's recommended k)
#     and pair.json (the draft chosen to serve).
# Usage: benchmarks/gpu/pack.sh RUN_DIR     (e.g. runs/demo-medium, after `spectune run configs/demo-medium.yaml`)
set -euo pipefail
run_dir=${1:?usage: pack.sh RUN_DIR}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../../.venv/bin/python}
payload=$here/payload
for needed in "$run_dir/gguf/export.json" "$run_dir/gguf/pair.json" "$run_dir/acceptance.json" "$run_dir/data/eval.jsonl"; do
  [[ -f $needed ]] || { echo "pack.sh: $needed is missing: is $run_dir a finished spectune run?" >&2; exit 2; }
done
rm -rf "$payload.tmp" && mkdir -p "$payload.tmp/wheels" "$payload.tmp/pair"

version=$("$python" -c "from importlib.metadata import version; print(version('llama-cpp-python'))")
sdist=$("$python" -c "from spectune.llama_cpp_pin import fetch_sdist; print(fetch_sdist())")
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
rm -rf "$work/llama_cpp_python-$version"/{.git,.github} "$src"/.github "$src"/{models,docs,media,benches,tests,tools/ui,tools/server/public,pocs,gguf-py/tests}
for backend in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "$src/ggml/src/ggml-$backend"
done
# The CMake files still reference these folders; empty placeholders keep configure happy.
mkdir -p "$src/tests" "$src/pocs" && : > "$src/tests/CMakeLists.txt" && : > "$src/pocs/CMakeLists.txt"
tar -czf "$payload.tmp/llama_cpp_python-$version.tar.gz" -C "$work" "llama_cpp_python-$version"

"$python" -m pip download -q --no-deps --only-binary=:all: -d "$payload.tmp/wheels" \
  scikit-build-core packaging pathspec diskcache jinja2 typing-extensions rich markdown-it-py mdurl pygments
"$python" -m pip download -q --no-deps --no-binary=:all: -d "$payload.tmp/wheels" markupsafe

cp "$run_dir"/gguf/*.gguf "$run_dir/gguf/pair.json" "$run_dir/acceptance.json" "$payload.tmp/pair/"
cp "$run_dir/data/eval.jsonl" "$payload.tmp/pair/prompts.jsonl"
rm -rf "$payload" && mv "$payload.tmp" "$payload"
size=$(du -sm "$payload" | cut -f1)
echo "payload: $payload, $size MiB (limit 64)"
(( size <= 60 )) || { echo "pack.sh: payload over 60 MiB" >&2; exit 1; }
