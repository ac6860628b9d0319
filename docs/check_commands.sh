#!/usr/bin/env bash
# Runs the docs' commands as written, from the repository root, and stops at the first that exits non-zero.
#   bash docs/check_commands.sh            the cheap ones: every command's --help and `offload plan` on shipped
#                                          profiles (seconds; needs .venv, which `make demo` or `make test` builds)
#   bash docs/check_commands.sh demo       also `make demo` and every command of the docs that runs the demo model
#                                          (generate, budgets, the KV tiers, convert, a 1,000-request batch job)
#   bash docs/check_commands.sh probe      also `offload probe --quick` and `offload plan --hardware probe`
# Not run: `offload serve` (it serves until stopped), `--ray`, the benchmarks, and benchmarks/gpu/check.sh.
# tests/test_docs.py checks that every `offload ...` command in the docs parses; this script checks that they run.
set -uo pipefail
cd "$(dirname "$0")/.."

demo=0 probe=0
for arg in "$@"; do
    case "$arg" in
        demo) demo=1 ;;
        probe) probe=1 ;;
        *) echo "unknown argument $arg (demo, probe)" >&2; exit 2 ;;
    esac
done

run() {  # run COMMAND: print it, run it through the shell as written, stop the script if it fails
    echo "\$ $1"
    local start=$SECONDS
    if ! bash -c "$1" > /tmp/offload-check-commands.log 2>&1; then
        tail -n 30 /tmp/offload-check-commands.log
        echo "FAILED after $((SECONDS - start)) s: $1" >&2
        exit 1
    fi
    echo "  ok ($((SECONDS - start)) s)"
}

if [ "$demo" = 1 ]; then
    run "make demo"
fi
[ -x .venv/bin/offload ] || { echo ".venv/bin/offload is missing: run make demo (or bash $0 demo) first" >&2; exit 1; }

for command in generate serve batch eval probe convert plan; do
    run ".venv/bin/offload $command --help"
done
run ".venv/bin/offload plan --model opt-175b --hardware t4-16gb --prompt-len 512 --gen-len 32 --host-memory 208GB"
run ".venv/bin/offload --debug plan --model tinyllama-1.1b --hardware l4-24gb --prompt-len 128 --gen-len 16"
# docs/speculative.md
run ".venv/bin/offload plan --model llama-3.1-70b --hardware rtx4090-24gb --speculate self --acceptance 0.9"
run ".venv/bin/offload plan --model llama-3.1-70b --hardware rtx4090-24gb --speculate self --speculative-topk 4"

if [ "$demo" = 1 ]; then
    # README.md
    run '.venv/bin/offload generate --chat --prompt "What is paged memory?" --max-new-tokens 48'
    run '.venv/bin/offload generate --chat --prompt "What is a disk?" --device-memory 200MiB --kv-cache-memory 16MiB --show-placement'
    # docs/usage.md, docs/memory-tiers.md, docs/quantization.md, docs/serving.md: the embedded demo model, built once
    run '.venv/bin/python -c "from offload.demo import ensure_demo_model; print(ensure_demo_model())"'
    # docs/eval.md
    run '.venv/bin/offload eval --text tests/data/eval_text.txt --context 512'
    run '.venv/bin/offload eval --text tests/data/eval_text.txt --json --device-memory 200MiB --kv-cache-memory 16MiB'
    # docs/usage.md
    run '.venv/bin/offload generate --model ~/.cache/offload/demo-llama-v1 --prompt "Paged memory" --prompt "The scheduler" --temperature 0.8 --top-p 0.95 --seed 1 --max-new-tokens 48 --stop "."'
    run '.venv/bin/offload generate --model ~/.cache/offload/demo-llama-v1 --prompt "What is a page?" --chat --json'
    # docs/memory-tiers.md
    run '.venv/bin/offload generate --model ~/.cache/offload/demo-llama-v1 --prompt "Batching is" --device-memory 8MiB --kv-cache-memory 2MiB --show-placement'
    run '.venv/bin/offload generate --model ~/.cache/offload/demo-llama-v1 --device-memory 8MiB --prompt "Paged memory" --prompt "The scheduler" --prompt "Batching is" --max-new-tokens 16'
    run '.venv/bin/offload generate --model ~/.cache/offload/demo-llama-v1 --memory 1GiB --prompt "Paged memory" --max-new-tokens 8'
    kv='.venv/bin/offload generate --kv-host-memory 64MiB --kv-disk-memory 256MiB --offload-dir /tmp/offload-kv --kv-dtype int8 --prompt "Paged attention keeps the keys and values of every sequence in blocks of a fixed size, so" --prompt "Paged attention keeps the keys and values of every sequence in blocks of a fixed size, and"'
    run "mkdir -p /tmp/offload-kv"
    run "$kv"
    run "$kv"  # the second run finds the blocks on disk
    # docs/speculative.md
    run '.venv/bin/offload generate --speculate ngram --num-speculative-tokens 4 --prompt "Repeat exactly: one two three four five, one two three four five" --max-new-tokens 32'
    run '.venv/bin/offload generate --speculate ngram --num-speculative-tokens 8 --speculative-topk 3 --prompt "Repeat exactly: one two three four five, one two three four five" --max-new-tokens 32'
    run ".venv/bin/offload probe --speculate ngram"
    run '.venv/bin/offload generate --speculate self --num-speculative-tokens 4 --device-memory 200MiB --chat --prompt "What are three good habits for staying healthy?"'
    # docs/quantization.md (--out must not exist)
    run "rm -rf /tmp/demo-int4"
    run ".venv/bin/offload convert --model ~/.cache/offload/demo-llama-v1 --quant int4 --group-size 64 --out /tmp/demo-int4"
    run '.venv/bin/offload generate --model /tmp/demo-int4 --prompt "Paged memory"'
    # README.md and docs/batch.md: the job's files are written in the repository root, then removed
    job_files=(requests.jsonl results.jsonl results.jsonl.meta.json results.errors.jsonl summary.json)
    for f in "${job_files[@]}"; do
        [ -e "$f" ] && { echo "$f exists in the repository root: move it away first" >&2; exit 1; }
    done
    trap 'rm -f "${job_files[@]}"' EXIT
    run ".venv/bin/python -c \"import json; [print(json.dumps({'id': f'q{i}', 'messages': [{'role': 'user', 'content': f'Question {i}: what is a page?'}], 'max_tokens': 32})) for i in range(1000)]\" > requests.jsonl"
    run ".venv/bin/offload batch --input requests.jsonl --output results.jsonl --json-summary summary.json"
    run "test \$(wc -l < results.jsonl) = 1000"
fi

if [ "$probe" = 1 ]; then
    # docs/planning.md (--plot needs matplotlib, which the test extras install)
    run ".venv/bin/offload probe --quick"
    [ -e plan.png ] && { echo "plan.png exists in the repository root: move it away first" >&2; exit 1; }
    run ".venv/bin/offload plan --model llama-3.1-8b --hardware probe --device-memory 4GB --plot plan.png"
    run "rm plan.png"
fi
echo "every command ran"
