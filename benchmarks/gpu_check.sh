#!/usr/bin/env bash
# Issue 37's GPU check: benchmarks/speed.py --only static,greedy on a CUDA machine without network (the H200 of
# ../shared/GPU.md: python3 3.12, torch 2.11, transformers 5.17, no trl, no gguf). What it needs, made here by
# `prepare` in benchmarks/runs/gpu/ (ignored by git), travels in two device calls, as one carries at most 64 MiB:
#
#   bash benchmarks/gpu_check.sh prepare   # wheels (22 MB), SmolLM2's tokenizer files, the GGUF gzipped in 2 parts
#   device call 1: carry benchmarks/runs/gpu/whl, benchmarks/runs/gpu/tokenizer, benchmarks/runs/gpu/part1;
#       command `bash benchmarks/gpu_check.sh run1`, timeout_s 600 (about 6 min): the SmolLM2-360M shape
#   device call 2, at once (the machine, its /tmp/site and part1 stay for 30 s): carry benchmarks/runs/gpu/part2;
#       command `bash benchmarks/gpu_check.sh run2`, timeout_s 600 (about 6 min): the greedy answers, the 135M shape
#
# Each writes its tables to $OUT (speed-cuda-360M.md; greedy-cuda.md, speed-cuda-135M.md) and log.txt. A run that
# fails or outlasts its limit is a table row that says so. `bash benchmarks/gpu_check.sh smoke`, after prepare, runs
# both calls' lines on this machine's CPU at tiny sizes (about 2 min, one thread).
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=benchmarks/runs/gpu
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# GPU.md's list but hf_xet (huggingface_hub imports it only to download), and gguf to read the model file.
WHEELS="transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 regex==2026.11.19 click==8.4.2
  httpx2==2.16.2 httpcore2==2.16.2 truststore idna==3.20 anyio==4.16.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1
  multiprocess==0.70.19 accelerate==1.16.0 gguf==0.19.0"
# PY, DEVICE, NO_INSTALL, EXTRA (more speed.py flags, the later win) and SLOW (times the limits) are for `smoke`.
PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; SLOW=${SLOW:-1}

setup() {  # the log, the wheels (installed by run1, still there for run2 on the warm machine), the versions
  mkdir -p "$OUT" && exec > >(tee "$OUT/log.txt") 2>&1
  export PYTHONUNBUFFERED=1 RL_CACHE_DIR=/tmp/rl-cache
  nvidia-smi -L; $PY --version
  if [ -z "${NO_INSTALL:-}" ]; then
    [ -d /tmp/site/transformers ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site $GPU/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  $PY -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__,
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" || exit 1
}

static() {  # speed.py's static table for one shape, under a limit of $2 seconds
  timeout $(($2 * SLOW)) $PY benchmarks/speed.py --device $DEVICE --only static --shapes "$1" --static-steps 6 \
    --run-timeout 240 --tokenizer $GPU/tokenizer --out "$OUT/speed-$DEVICE-${1#SmolLM2-}.md" ${EXTRA:-}
  echo "static $1: exit $?, ${SECONDS} s so far"
}

case "${1:-}" in
prepare)
  PY=${PYTHON:-python}
  rm -rf $GPU && mkdir -p $GPU/whl $GPU/tokenizer || exit 1
  # Python 3.12 wheels for the GPU machine; --no-deps, so each is named.
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d $GPU/whl $WHEELS || exit 1
  # The GGUF's converted folder (converted here once) holds SmolLM2-135M's config.json and its tokenizer files.
  folder=$(cd benchmarks && $PY -c "import speed; print(speed.default_tokenizer())") || exit 1
  cp "$folder"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
    $GPU/tokenizer/ || exit 1
  gguf=$(cd benchmarks && $PY -c "import real; print(real.gguf_file())") || exit 1
  # part1 rides with the wheels and the tokenizer, part2 (the larger) alone: each call under 64 MiB with the tree.
  gzip -c "$gguf" > $GPU/gguf.gz && head -c 35000000 $GPU/gguf.gz > $GPU/part1 &&
    tail -c +35000001 $GPU/gguf.gz > $GPU/part2 && rm $GPU/gguf.gz || exit 1
  du -sh $GPU/* ;;
run1)  # device call 1: the 360M shape, the longer of the two (its limit leaves room for the call's own start)
  setup
  static SmolLM2-360M 560 ;;
run2)  # device call 2: the real model's greedy answers, then the 135M shape
  setup
  if [ -f $GPU/part1 ] && [ -f $GPU/part2 ]; then
    mkdir -p /tmp/gguf && cat $GPU/part1 $GPU/part2 | gunzip > /tmp/gguf/$GGUF_NAME || exit 1
    TORCH_LOGS=recompiles,perf_hints timeout $((220 * SLOW)) $PY benchmarks/speed.py --device $DEVICE \
      --only greedy --gguf /tmp/gguf/$GGUF_NAME --out "$OUT/greedy-$DEVICE.md" ${EXTRA:-}
    echo "greedy: exit $?, ${SECONDS} s so far"
  else
    echo "no $GPU/part1 (call 1 on a machine that has gone since?): the greedy comparison is skipped"
  fi
  static SmolLM2-135M $((570 - SECONDS / SLOW)) ;;
smoke)  # after prepare: both calls' lines on this machine's CPU, at tiny sizes, with limits 5 times as long
  for call in run1 run2; do
    OUT=${OUT:-/tmp/gpu-check-smoke}/$call PY=${PYTHON:-python} DEVICE=cpu NO_INSTALL=1 SLOW=5 OMP_NUM_THREADS=1 \
      EXTRA="--shapes tiny --static-steps 2 --greedy-prompts 2 --run-timeout 900" bash "$0" $call || exit 1
  done ;;
*)
  echo "usage: bash benchmarks/gpu_check.sh prepare | run1 | run2 | smoke"; exit 2 ;;
esac
