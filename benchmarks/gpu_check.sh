#!/usr/bin/env bash
# --static-cache's GPU check, benchmarks/gpu_check.py (its docstring says what it measures), in one run of at most
# 8 minutes on a CUDA machine without network that has Python 3.12, torch with Triton, a C compiler and Python's
# headers. What such a machine lacks, `prepare` makes here, on a machine with network, in benchmarks/runs/gpu/
# (ignored by git; about 26 MB, to carry there with the working tree):
#
#   bash benchmarks/gpu_check.sh prepare   # the wheels below (py3.12, manylinux) and SmolLM2's tokenizer files
#   bash benchmarks/gpu_check.sh run [DIR] # on the CUDA machine: installs the wheels into /tmp/site, then the check,
#                                          # all under 8 minutes; speed-cuda.md and log.txt go to DIR (default
#                                          # benchmarks/results), to be copied to benchmarks/results/speed-cuda.md
#   bash benchmarks/gpu_check.sh smoke [DIR]  # here: the same script on this CPU at a tiny shape (about a minute)
#
# Nothing is left on the machine for a later run to need. The real model's greedy answers (part 4) run only where its
# GGUF file already is (GGUF=path): at 98 MB it does not travel with the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=benchmarks/runs/gpu
# transformers >= 5.24 (the model's cache= keyword) and what it needs beyond the machine's own packages; trl for the
# comparison; gguf to read the real model. hf_xet is left out: huggingface_hub imports it only to download.
WHEELS="transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 regex==2026.11.19 click==8.4.2
  httpx2==2.16.2 httpcore2==2.16.2 truststore idna==3.20 anyio==4.16.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1
  multiprocess==0.70.19 accelerate==1.16.0 gguf==0.19.0"
LIMIT=480  # seconds for the whole run, the wheels' install included

case "${1:-}" in
prepare)
  PY=${PYTHON:-python}
  rm -rf $GPU && mkdir -p $GPU/whl $GPU/tokenizer || exit 1
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d $GPU/whl $WHEELS || exit 1
  # The GGUF's converted folder (benchmarks/real.py's model) holds SmolLM2-135M's config.json and tokenizer files.
  folder=$(cd benchmarks && $PY -c "import speed; print(speed.default_tokenizer())") || exit 1
  cp "$folder"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
    $GPU/tokenizer/ || exit 1
  du -sh $GPU/* ;;
run)
  PY=${PYTHON:-python3}; DIR=${2:-benchmarks/results}
  mkdir -p "$DIR" && exec > >(tee "$DIR/log.txt") 2>&1
  nvidia-smi -L; $PY --version
  # --upgrade: these replace the machine's older transformers and accelerate for this run only (PYTHONPATH)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $GPU/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 RL_CACHE_DIR=/tmp/rl-cache TORCHINDUCTOR_CUDAGRAPH_OR_ERROR=1 \
    TORCH_LOGS=recompiles,graph_breaks
  # The script skips what it has no time left for; timeout stops it if a part outlasts its share.
  timeout $((LIMIT - SECONDS)) $PY benchmarks/gpu_check.py --seconds $((LIMIT - 20 - SECONDS)) \
    --tokenizer $GPU/tokenizer --out "$DIR/speed-cuda.md" ${GGUF:+--gguf "$GGUF"}
  rc=$?; echo "gpu_check.py: exit $rc, ${SECONDS} s in all"; exit $rc ;;
smoke)
  DIR=${2:-/tmp/gpu-check-smoke}
  OMP_NUM_THREADS=1 TORCH_LOGS=recompiles,graph_breaks ${PYTHON:-python} benchmarks/gpu_check.py --cpu \
    --out "$DIR/speed-cpu.md" ${TOKENIZER:+--tokenizer "$TOKENIZER"}
  rc=$?; echo "gpu_check.py --cpu: exit $rc, ${SECONDS} s; the table: $DIR/speed-cpu.md"; exit $rc ;;
*)
  echo "usage: bash benchmarks/gpu_check.sh prepare | run [DIR] | smoke [DIR]"; exit 2 ;;
esac
