#!/usr/bin/env bash
# Everything a lent GPU machine should check, in two calls of the device tool (one command may run 10 minutes,
# a task has 15 in all, start-up included): the test suite with its models on the GPU (pytest --device cuda,
# the layer seams compiled as on every CUDA run), then the loading benchmark (eval/bench_load.py) and a
# shortened 7B benchmark (eval/gpu_bench.sh). Logs and results go to $OUT (eval/results/ elsewhere).
#
#   here, once:   bash eval/gpu_check.sh --prepare
#                 (gpu_bench.sh's data, tokenizer and sentence-transformers wheel, plus the wheels the
#                 suite's server tests need and the device image lacks, all into .gpu_carry/)
#   device:       run(command="bash eval/gpu_check.sh suite", carry=[".gpu_carry"], timeout_s=560)
#                 run(command="bash eval/gpu_check.sh bench", carry=[".gpu_carry"], timeout_s=300)
#                 (no argument: both, for a machine without the 10-minute limit)
#   dry run:      PYTHON=.venv/bin/python bash eval/gpu_check.sh --dry-run   (CPU: a few tests, 2 narrow layers)
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_carry
PYTHON=${PYTHON:-python3}
OUT=${OUT:-eval/results/gpu-check-$(date +%Y-%m-%d-%H%M)}
mkdir -p "$OUT"

# Server and test dependencies missing from the device image (its list: .library/device/KINDS.md), at the
# versions this project's CPU environment runs.
SERVER_WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0
typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 uvicorn==0.54.0 orjson==3.13.0
openai==3.57.0 jiter==0.19.0 distro==1.9.0"

if [ "${1:-}" = "--prepare" ]; then
    bash eval/gpu_bench.sh --prepare
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$CARRY/wheels" $SERVER_WHEELS
    du -sh "$CARRY"
    exit 0
fi

DRY=""
PART=${1:-all}
if [ "$PART" = "--dry-run" ]; then
    DRY=1
    PART=all
elif compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/wheels/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PYTHON" -c "import torch, transformers, sentence_transformers as st; print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', \
'| transformers', transformers.__version__, '| sentence-transformers', st.__version__)" | tee "$OUT/versions.txt"

# The modules whose models run on the suite's device; the rest (corpus job, Ray, CLI errors, MTEB, the
# stand-ins) run on the CPU whatever --device says, and are the CPU CI's.
CPU_ONLY=(test_corpus.py test_corpus_ray.py test_corpus_integrity.py test_corpus_ray_integrity.py test_cuda_path.py
          test_mteb.py test_quality.py test_integrations.py test_cli.py test_cli_errors.py test_serve_guard.py
          test_serve_connections.py test_sentence_transformers_hooks.py test_layouts.py test_int8.py test_chunking.py
          test_cross_encoder_serve.py)
if [ "$PART" = "all" ] || [ "$PART" = "suite" ]; then
    echo "== 1. the test suite on the GPU"
    if [ -n "$DRY" ]; then
        SUITE=(--device cpu tests/test_attention.py tests/test_cuda_path.py)
    else
        SUITE=(--device cuda tests "${CPU_ONLY[@]/#/--ignore=tests/}")
    fi
    # 480 s: compiling the seams (Triton, once per dtype) and ~40 models on 16 CPU cores; the call's limit is 600.
    timeout 480 "$PYTHON" -m pytest "${SUITE[@]}" -p no:cacheprovider -rs --junitxml="$OUT/tests.xml" 2>&1 \
        | tee "$OUT/tests.log" | tail -40
fi

if [ "$PART" = "all" ] || [ "$PART" = "bench" ]; then
    echo "== 2. loading: time to first embedding and host memory, plain vs fast"
    if [ -z "$DRY" ]; then
        timeout 90 "$PYTHON" eval/bench_load.py --device cuda --rounds 1 --tokenizer "$CARRY/tokenizer" \
            --out "$OUT/load.json" 2>&1 | tee "$OUT/load.log"
    fi

    echo "== 3. the 7B benchmark, shortened"
    if [ -n "$DRY" ]; then
        PYTHON="$PYTHON" OUT="$OUT" timeout 600 bash eval/gpu_bench.sh --dry-run 2>&1 | tail -15
    else
        OUT="$OUT" timeout 150 bash eval/gpu_bench.sh --lengths 512 8192 --paragraphs 512 2>&1 | tee "$OUT/bench.log" \
            | tail -15
    fi
fi
echo "== summary"
[ -f "$OUT/tests.log" ] && grep -E "passed|failed" "$OUT/tests.log" | tail -1
[ -f "$OUT/load.log" ] && tail -5 "$OUT/load.log"
true
