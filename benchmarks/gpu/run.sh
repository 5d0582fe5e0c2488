#!/usr/bin/env bash
# The speedup measured for real, on a CUDA machine (no network): two steps, each under 10 minutes on an H200 box.
#   benchmarks/gpu/run.sh build OUT   builds llama-cpp-python for this card from the shipped sdist (CUDA, sm_90 by
#                                     default: CUDA_ARCH=...), its examples with it (llama-speculative-simple, the peer)
#   benchmarks/gpu/run.sh bench OUT   the bench on the shipped pair: target alone vs each draft, interleaved, and
#                                     llama.cpp's own decoder beside ours; OUT/report.json, OUT/speculative_gpu.json
# Needs: benchmarks/gpu/pack.sh run first here (payload/), and python3 with numpy, CUDA, nvcc, cmake, ninja there.
set -euo pipefail
step=${1:?usage: run.sh build|bench OUT}
out=$(mkdir -p "${2:?usage: run.sh build|bench OUT}" && cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
payload=$here/payload
venv=$payload/venv
[[ -d $payload/pair ]] || { echo "run.sh: no $payload: run benchmarks/gpu/pack.sh RUN_DIR first" >&2; exit 2; }

case $step in
build)
  python3 -c "import numpy" || { echo "run.sh: python3 has no numpy" >&2; exit 2; }
  python3 -m venv --system-site-packages "$venv"  # torch and numpy come from the machine
  "$venv/bin/pip" install -q --no-index --find-links "$payload/wheels" \
    scikit-build-core packaging pathspec diskcache jinja2 markupsafe typing-extensions rich
  # llamafile off as in `make install`: layers left on the CPU then batch like they decode (README "Identical answers").
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}} -DLLAMA_BUILD_EXAMPLES=ON -DGGML_LLAMAFILE=OFF"
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  time "$venv/bin/pip" install --no-index --no-build-isolation --no-deps \
    --config-settings=build-dir="$payload/build" "$payload"/llama_cpp_python-*.tar.gz 2>&1 | tail -5
  peer=$(find "$payload/build" -name llama-speculative-simple -type f -perm -u+x | head -1)
  [[ -n $peer ]] || { echo "run.sh: the build made no llama-speculative-simple" >&2; exit 1; }
  ln -sf "$peer" "$payload/llama-speculative-simple"
  "$venv/bin/python" -c "import llama_cpp; print('llama.cpp GPU offload:', llama_cpp.llama_supports_gpu_offload())" \
    | tee "$out/build.txt"
  ;;
bench)
  PYTHONPATH=$here/../../src "$venv/bin/python" "$here/bench.py" --pair "$payload/pair" \
    --peer "$payload/llama-speculative-simple" --out "$out"
  ;;
*) echo "run.sh: unknown step $step (build or bench)" >&2; exit 2 ;;
esac
