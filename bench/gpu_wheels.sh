#!/usr/bin/env bash
# The wheels bench/gpu_check.py's zero2_rl_step checks need on the GPU check machine, which has torch and
# transformers but no DeepSpeed, omegaconf or peft (and no network): about 6 MB, downloaded here into .gpu_wheels/
# (ignored by git) for the device tool to carry (`carry: [".gpu_wheels"]`). Pure-Python wheels, plus the
# compiled ones (msgpack, pydantic-core, psutil) for CPython 3.10-3.13; DeepSpeed is built into a
# py3-none-any wheel from its sdist here (no ops compiled: DS_BUILD_OPS=0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.gpu_wheels
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps -d "$OUT" omegaconf==2.4.0 hjson py-cpuinfo \
  einops ninja pydantic annotated-types typing-inspection typing-extensions peft==0.21.2 accelerate
for v in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 \
    -d "$OUT" msgpack==1.2.4 pydantic-core psutil || echo "no $v wheels for msgpack/pydantic-core"
done
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8
du -sh "$OUT"
