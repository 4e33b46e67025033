#!/usr/bin/env bash
# The GPU suite: one command that settles on a lent card whether the walk is exact and fast there. Steps run by
# priority, each in its own process under its own limit; every step is a row of the summary (ok, failed, a
# timeout, skipped for the deadline), and what is written reaches $OUT as soon as it is written, so a cut loses
# only the step it cut.
#
# The device command (one lent GPU, one call of at most 10 minutes; carry [".whl"]; .whl/ holds the
# prefix-grouper wheel: `pip download --no-deps prefix-grouper==0.0.1.post1 -d .whl`):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/gpu.sh /tmp/gpu-suite
#
# Other forms:
#
#   bash benchmarks/gpu.sh [OUT_DIR]            # a CUDA machine (default OUT_DIR: benchmarks/out/gpu)
#   bash benchmarks/gpu.sh --dry-run [OUT_DIR]  # any machine: the same steps on the CPU at toy sizes (~6 min)
#   PYTHON=.venv-gpu/bin/python bash benchmarks/gpu.sh --dry-run /tmp/gpu-dry   # in the GPU machine's packages
#   DEADLINE_S=120 bash benchmarks/gpu.sh --dry-run /tmp/gpu-cut                 # cut short: steps skipped
#
# Written for the project's CUDA machines: one H100 80 GB (the device tool's default kind) or one H200 141 GB,
# torch 2.11 + CUDA 13, transformers 5.17, accelerate 1.15, no TRL, no datasets, no flash-attn, no internet.
# prefix-grouper comes from $WHEELS (default .whl/; a flash_attn-*.whl there is installed too) unless it is
# importable already; trl_dta is used from this checkout (PYTHONPATH), not installed. torch 2.11 is below the
# supported floor (torch>=2.13, pyproject.toml): the suite runs anyway and env.txt says so.
#
# Budget: DEADLINE_S (default 500 s on a GPU, leaving the device tool's 600 s room for the table's overrun, a
# step's kill and the tarball; 900 s in a dry run) counted from the start; a step gets at most what is left and
# is skipped, as a row, when less than its minimum is left.
#
# Steps, in order (GPU; the dry run runs each on the CPU, smaller), and what a failure means:
#   1. environment: versions, the card, `import trl_dta` without TRL                          (information)
#   2. bf16 parity, first (`flash_parity.py`): Qwen3-0.6B's dims, 28 layers, a GRPO group, a τ² slice and
#      one-query segments walked with torch's flash varlen kernel and with sdpa per segment, and run dense, on
#      the same bf16 weights, each against an fp32 reference; the flash path within 1.5x the sdpa path's error
#      + 2e-3, every kind of kernel call seen (packed, lone read in place, the checkpointed recompute, long,
#      one-query, GQA), the kernel's own check passed (a failed check is a failure here)      (exactness)
#   3. the decisive table (`gpu_table.py`, at most TABLE_BUDGET=300 s): Qwen3-0.6B grpo-4k-g16 (and the walk at
#      a budget under half PrefixGrouper's peak), Qwen3-1.7B tau2 x1/8, Qwen3-0.6B full tau2; a process per
#      (configuration, method); the targets stated per card                                  (the table)
#   4. the plan: `peers.py --plan`, every method's estimated peak against this card          (information)
#   5. fp32 parity (`peers.py --parity`, TF32 off): every method against dense on tiny tries (exactness)
#   6. profile (`gpu_profile.py`): GPU busy vs idle, host time per decoder-layer call        (information)
#   7. the cost model fitted on this GPU: `call_costs.py`, then `cost_fit.py`                (information)
#   8. the device-sized walk (`device_walk.py`, Qwen3-1.7B shape, tau2 x1/8): segments (flash), segments
#      through sdpa, the mask path; its JSON after each side                                 (information)
#   9. FSDP2 smoke test (`fsdp2_smoke.py`, gather-once and per layer, fp32)                   (exactness)
#  10. memory next to a colocated vLLM engine (`vllm_memory.py`)                              (information)
#  11. soak (`soak.py`): 200 walks with an injected out-of-memory retry                       (information)
#  12. the GPU plan on paper (`launch_model.py`)                                              (information)
#  13. flex attention last, each under its own limit (its first call compiles; it hit dynamo's recompile limit on
#      2026-12-04): its fp32 exactness (exactness), then its walk beside the others (`device_walk.py`;
#      information)
# Exit: 0 when the decisive table is complete (its rows may be OOM, timeouts or skipped, not a crashed walk)
# and no exactness step failed; 1 otherwise. A step's timeout is a row, never the script's exit code.
# Outputs (OUT_DIR): summary.md (the steps, then the decisive table and the bf16 parity), gpu_table.md/.json,
# gpu_table_rows/, flash_parity_bf16.json, env.txt, plan.txt, parity.json, gpu_profile.*, call_costs_cuda.json,
# cost_fit_cuda.json, device_walk.json, device_walk_flex.json, flex_parity.json, fsdp2_smoke*.json,
# vllm_memory*.json, soak*, launch_model.json, a log per step, steps.tsv, gpu_sh.log; OUT_DIR.tgz beside it
# (or $TGZ). Where $OUT is set (the device tool), the tarball, summary.md, gpu_table.md, flash_parity_bf16.json
# and gpu_sh.log are copied there after every step and every 20 s.
set -uo pipefail  # (no -e: a failing step is a row, and the steps after it still run)
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
OUT_DIR="${1:-benchmarks/out/gpu}"
OUT_DIR="${OUT_DIR%/}"
TGZ="${TGZ:-$OUT_DIR.tgz}"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"
DEADLINE_S="${DEADLINE_S:-$([ $DRY = 1 ] && echo 900 || echo 500)}"  # (GPU: under the device tool's 600 s)
TABLE_BUDGET="${TABLE_BUDGET:-300}"
STARTED=$SECONDS
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/gpu_sh.log"
: > "$OUT_DIR/steps.tsv"
exec 4>&1 5>&2 > >(tee -a "$OUT_DIR/gpu_sh.log") 2>&1  # (4, 5: the console, for the end)
TEE_PID=$!
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $DRY = 1 ]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # (a shared CPU: the scripts without a --threads flag too)
fi
PEERS=benchmarks/peers.py

# ---- what reaches $OUT, and when: after every step, and every 20 s from a background loop
published() { [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$(cd "$OUT" && pwd)" != "$(cd "$OUT_DIR" && pwd)" ]; }
summary() {  # the steps so far, then the decisive table and the bf16 parity's lines
    echo "# GPU suite $([ $DRY = 1 ] && echo '(dry run) ')$(date -u +%FT%TZ), $((SECONDS - STARTED)) s"
    echo
    echo "| step | kind | status | s |"
    echo "|---|---|---|---|"
    awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' "$OUT_DIR/steps.tsv"
    echo
    cat "$OUT_DIR/gpu_table.md" 2>/dev/null || echo "(no decisive table yet)"
    if [ -f "$OUT_DIR/flash_parity.log" ]; then
        echo
        echo "## bf16 parity (flash_parity.py)"
        grep -E "^(grpo|tau2|one-query|kernel calls|FAILED|bf16 parity)" "$OUT_DIR/flash_parity.log" | sed 's/^/    /'
    fi
}
publish() {  # [final]: the tarball is made even where no $OUT is set
    local new=".new$BASHPID"  # (the background loop and the script may publish at once)
    summary > "$OUT_DIR/summary.md$new" 2>/dev/null && mv "$OUT_DIR/summary.md$new" "$OUT_DIR/summary.md"
    published || [ "${1:-}" = final ] || return 0
    local rc=0  # (tar exits 1 where a log grew while it read it: the archive is still whole)
    tar --warning=no-file-changed -czf "$TGZ$new" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" \
        2>/dev/null || rc=$?
    if [ "$rc" -le 1 ]; then mv "$TGZ$new" "$TGZ"; else rm -f "$TGZ$new"; fi
    published || return 0
    for f in "$TGZ" "$OUT_DIR/summary.md" "$OUT_DIR/gpu_table.md" "$OUT_DIR/flash_parity_bf16.json" \
        "$OUT_DIR/gpu_sh.log"; do
        [ -f "$f" ] && cp "$f" "$OUT/$(basename "$f")$new" && mv "$OUT/$(basename "$f")$new" "$OUT/$(basename "$f")"
    done
    return 0
}
( while sleep 20; do publish; done ) > /dev/null 2>&1 &
PUBLISHER=$!
CURRENT=""  # the running step's process (its timeout)
on_signal() {  # killed from outside (the device tool's limit): end the step, publish what there is, exit 1
    trap - TERM INT
    kill "$PUBLISHER" 2>/dev/null
    [ -n "$CURRENT" ] && kill -TERM "$CURRENT" 2>/dev/null
    record "(cut here by a signal)" - "killed" 0
    publish final
    exit 1
}
trap on_signal TERM INT
trap 'kill "$PUBLISHER" 2>/dev/null' EXIT

# ---- offline installs (only what is missing) and the scripts' syntax, quietly
install_wheel() {  # module, wheel glob
    if "$PY" -c "import $1" 2>/dev/null; then
        echo "$1: already importable"
    elif compgen -G "$WHEELS/$2" >/dev/null; then
        "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/$2
    else
        echo "$1: not importable and no $WHEELS/$2 wheel"
        return 1
    fi
}
if ! install_wheel prefix_grouper 'prefix_grouper-*.whl' > "$OUT_DIR/install.log" 2>&1; then
    cat "$OUT_DIR/install.log"
    echo "prefix-grouper is required (pip download --no-deps prefix-grouper==0.0.1.post1 -d .whl)"
    exit 1
fi
install_wheel flash_attn 'flash_attn-*.whl' >> "$OUT_DIR/install.log" 2>&1 || true
"$PY" -m py_compile "$PEERS" benchmarks/common.py benchmarks/peer_bench/*.py benchmarks/gpu_table.py \
    benchmarks/gpu_table_row.py benchmarks/gpu_profile.py benchmarks/fsdp2_smoke.py benchmarks/launch_model.py \
    benchmarks/device_walk.py benchmarks/vllm_memory.py benchmarks/cost_fit.py benchmarks/call_costs.py \
    benchmarks/flash_parity.py || exit 1
if [ $DRY = 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device (use --dry-run on CPU)')" \
        || exit 1
fi

# ---- the step runner: a row per step in steps.tsv (name, kind, status, seconds)
left() { echo $((DEADLINE_S - (SECONDS - STARTED))); }
quiet() { grep -v -E "(Future|User|Deprecation)Warning|warnings\.warn\(|profiler_st" || true; }  # (not flash's)
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT_DIR/steps.tsv"; }
step() {  # step NAME KIND MIN_S MAX_S LOG TAIL COMMAND...: COMMAND under timeout min(MAX_S, what is left),
    local name=$1 kind=$2 min=$3 max=$4 log=$5 lines=$6  # its output in OUT_DIR/LOG, its last TAIL lines shown
    shift 6
    local budget rc=0 status t0=$SECONDS
    budget=$(left)
    [ "$min" = 0 ] && [ "$budget" -lt "$max" ] && budget=$max  # (a step that is never skipped: its own limit)
    if [ "$budget" -lt "$min" ]; then
        echo "== $name: skipped (${budget}s left of DEADLINE_S=${DEADLINE_S}, it needs ${min}s)"
        record "$name" "$kind" "skipped (deadline: ${budget}s left, needs ${min}s)" 0
        publish
        return 0
    fi
    [ "$budget" -lt "$max" ] && max=$budget
    echo "== $name (at most ${max}s; $(left)s left)"
    # (in the background, waited for: a signal to the script is handled at once, not after the step)
    timeout --kill-after=10 "$max" "$@" 0<&0 >> "$OUT_DIR/$log" 2>&1 &
    CURRENT=$!
    wait "$CURRENT" || rc=$?
    CURRENT=""
    quiet < "$OUT_DIR/$log" | tail -n "$lines"
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout (${max}s)" ;;
        *) status="failed (exit $rc)" ;;
    esac
    [ "$rc" = 0 ] || echo "== $name: $status"
    record "$name" "$kind" "$status" $((SECONDS - t0))
    publish
}

if [ $DRY = 1 ]; then
    DEVICE=cpu
    PARITY_ARGS=(--device cpu --dims tiny --scale 0.25 --threads 1)
    TABLE_ARGS=(--device cpu --model tiny --scale 0.03125 --configs 1 --inject_oom dense --threads 1)
    PROFILE_ARGS=(--device cpu --model tiny --scale 0.03125 --threads 1)
    WALK_ARGS=(--device cpu --dims tiny --layers 2 --scale 0.03125 --repeats 1)
else
    DEVICE=cuda
    PARITY_ARGS=(--device cuda)
    TABLE_ARGS=(--device cuda)
    PROFILE_ARGS=(--device cuda --model qwen3-0.6b --scale 0.25)
    WALK_ARGS=(--device cuda --scale 0.125)
fi
echo "== gpu.sh $([ $DRY = 1 ] && echo '--dry-run ')-> $OUT_DIR ($(date -u +%FT%TZ)), DEADLINE_S=$DEADLINE_S"

# ---- 1. the environment
step "environment" information 10 60 env.txt 12 "$PY" - <<'PY'
import sys, time
t = time.perf_counter()
import trl_dta
from trl_dta import PrefixTrie, TreeExecutor  # the executor path: torch + transformers, never TRL
from trl_dta.testing.memory import SavedTensorMeter  # noqa: F401
assert "trl" not in sys.modules, "the executor path imported TRL"
print(f"import trl_dta + executor: {time.perf_counter() - t:.2f} s, TRL not imported")
import torch, transformers, prefix_grouper
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"transformers {transformers.__version__}, prefix_grouper {prefix_grouper.__version__}")
try:
    import flash_attn
    print(f"flash_attn {flash_attn.__version__}")
except ImportError:
    print("flash_attn: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.1f} GiB")
else:
    print("gpu: none")
import re
floor = re.search(r'"torch>=([0-9]+)\.([0-9]+)', open("pyproject.toml").read())
have = re.match(r"([0-9]+)\.([0-9]+)", torch.__version__)
if floor and have and tuple(map(int, have.groups())) < tuple(map(int, floor.groups())):
    print(f"note: torch {torch.__version__} is below the supported floor, torch>={'.'.join(floor.groups())} "
          "(pyproject.toml): this suite runs anyway, untested by CI at this version")
PY

# ---- 2. bf16 parity, first: the flash kernel's gradients at a real shape
step "bf16 parity (flash kernel vs sdpa vs dense, each vs fp32)" exactness 30 180 flash_parity.log 12 \
    "$PY" benchmarks/flash_parity.py "${PARITY_ARGS[@]}" --out "$OUT_DIR"

# ---- 3. the decisive table: a process per (configuration, method). Never skipped: with no time left its rows
# say "skipped (deadline)", and the table is still written
budget=$(( $(left) - 30 < TABLE_BUDGET ? $(left) - 30 : TABLE_BUDGET ))
[ "$budget" -lt 0 ] && budget=0
step "decisive table" table 0 $((budget + 60)) gpu_table.log 40 \
    "$PY" benchmarks/gpu_table.py "${TABLE_ARGS[@]}" --budget "$budget" --out "$OUT_DIR"

# ---- 4. the plan: each method's estimated peak against this card
step "plan" information 10 60 plan.txt 26 "$PY" "$PEERS" --profile gpu --device "$DEVICE" --micro_batch 2 \
    --no_sweep --methods dense,dense_ckpt,pg,tree_mask,tree --plan

# ---- 5. fp32 parity of every method
ATTN=sdpa
[ $DRY = 0 ] && "$PY" -c "import flash_attn" 2>/dev/null && ATTN=sdpa,flash_attention_2
if [ $DRY = 1 ]; then
    step "fp32 parity, cpu" exactness 60 600 parity.log 28 "$PY" "$PEERS" --parity --device cpu --attn sdpa \
        --threads 1 --out "$OUT_DIR"
else
    step "fp32 parity, cuda ($ATTN)" exactness 60 120 parity.log 40 "$PY" "$PEERS" --parity --device cuda \
        --attn "$ATTN" --out "$OUT_DIR"
fi

# ---- 6. profile: one walk and one dense + ckpt step under torch.profiler
step "profile: a walk and a dense + ckpt step, grpo-4k-g16" information 30 75 gpu_profile.log 8 \
    "$PY" benchmarks/gpu_profile.py "${PROFILE_ARGS[@]}" --out "$OUT_DIR"

# ---- 7.-12. the older steps, while the deadline allows
if [ $DRY = 1 ]; then
    step "cost model fitted online (smoke: 2 layers, 3 steps)" information 30 300 cost_fit.log 4 "$PY" \
        benchmarks/cost_fit.py --device cpu --hidden 72 --layers 2 --steps 3 --compare 1 --threads 1 \
        --offline docs/call-costs-cpu.json --out "$OUT_DIR"
else
    step "call costs on this GPU (the offline fit)" information 45 150 cost_fit.log 5 "$PY" \
        benchmarks/call_costs.py --device cuda --hidden 1152 --layers 8 --out "$OUT_DIR"
    step "cost model fitted online on this GPU" information 60 240 cost_fit.log 32 "$PY" benchmarks/cost_fit.py \
        --device cuda --hidden 1152 --layers 8 --memory 60e9 --steps 12 --offline "$OUT_DIR/call_costs_cuda.json" \
        --peers --out "$OUT_DIR"
fi
step "device-sized walk (segments with flash, segments through sdpa, mask)" information 60 240 device_walk.log 8 \
    "$PY" benchmarks/device_walk.py "${WALK_ARGS[@]}" --out "$OUT_DIR"
for mode in "" --per_layer; do
    if [ $DRY = 1 ]; then
        FSDP_ARGS=(--device cpu --hidden 256 --layers 4)
    else
        FSDP_ARGS=(--device cuda --hidden 2048 --layers 8)
    fi
    step "FSDP2 smoke test, fp32 ${mode:-gather-once}" exactness 30 120 "fsdp2_smoke${mode:+_per_layer}.log" 15 \
        "$PY" benchmarks/fsdp2_smoke.py "${FSDP_ARGS[@]}" $mode --out "$OUT_DIR"
done
"$PY" benchmarks/vllm_memory.py --paper --out "$OUT_DIR" > "$OUT_DIR/vllm_memory_paper.log" 2>&1 || true
if [ $DRY = 1 ]; then
    step "vLLM memory (1 layer, lengths x 1/50; no peaks on CPU)" information 30 300 vllm_memory.log 2 "$PY" \
        benchmarks/vllm_memory.py --device cpu --layers 1 --scale 0.02 --out "$OUT_DIR"
    step "soak (20 steps)" information 30 300 soak.log 3 "$PY" benchmarks/soak.py --mode executor --device cpu \
        --steps 20 --every 5 --warmup 5 --oom_at 8 --hidden 64 --out "$OUT_DIR"
    step "launch model (lengths x 1/8)" information 30 300 launch_model.log 2 "$PY" benchmarks/launch_model.py \
        --scales 0.125 --cards "" --launch_factors 2 --out "$OUT_DIR"
else
    step "vLLM memory: walk vs dense + gradient checkpointing" information 60 240 vllm_memory.log 3 "$PY" \
        benchmarks/vllm_memory.py --device cuda --scale 1 --out "$OUT_DIR"
    step "soak (optional)" information 60 150 soak.log 3 "$PY" benchmarks/soak.py --mode executor --device cuda \
        --steps 200 --oom_at 60 --hidden 1024 --out "$OUT_DIR" --plot "$OUT_DIR/soak_executor.png"
    step "launch model (kernels and FLOPs per step, Qwen3-1.7B, tau2-2x8-10k)" information 120 420 \
        launch_model.log 16 "$PY" benchmarks/launch_model.py --scales 0.125 --out "$OUT_DIR"
fi

# ---- 13. flex attention, last, each under its own limit: its fp32 exactness, then its walk (information: a
# compile or memory failure of the walk is not an exactness failure)
if [ $DRY = 1 ]; then
    record "flex attention: fp32 exactness" exactness "n/a (CPU: flex has no backward there)" 0
else
    step "flex attention: fp32 exactness" exactness 45 90 device_walk_flex.log 3 "$PY" \
        benchmarks/device_walk.py --device cuda --parity_only --out "$OUT_DIR"
    step "flex attention: its walk beside the others" information 60 120 device_walk_flex.log 6 "$PY" \
        benchmarks/device_walk.py "${WALK_ARGS[@]}" --sides flex_attention --name device_walk_flex --out "$OUT_DIR"
fi

# ---- the verdict: the summary (the device tool returns the tail of the output), the exit code
complete=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('complete', False))" \
    "$OUT_DIR/gpu_table.json" 2>/dev/null || echo False)
# (an exactness step that failed; the table's step failed: a walk row crashed, gpu_table.py's exit 1)
failed=$(awk -F'\t' '$2 ~ /^(exactness|table)$/ && $3 ~ /^failed/ {print $1}' "$OUT_DIR/steps.tsv" | paste -sd ';' -)
grep -q "FLASH CHECK FAILED" "$OUT_DIR/gpu_table.md" 2>/dev/null && failed="${failed:+$failed; }the flash kernel's check"
skipped=$(awk -F'\t' '$3 ~ /^(skipped|timeout)/ {print $1}' "$OUT_DIR/steps.tsv" | paste -sd ';' -)
echo
summary
echo
echo "== table complete: $complete; exactness failures: ${failed:-none}; skipped or timed out: ${skipped:-none}" \
    "($(date -u +%FT%TZ), $((SECONDS - STARTED)) s); outputs in $OUT_DIR, tarred into $TGZ"
rc=0
if [ "$complete" != True ] || [ -n "$failed" ]; then
    rc=1
fi
kill "$PUBLISHER" 2>/dev/null
wait "$PUBLISHER" 2>/dev/null
exec 1>&4 2>&5  # (the log's tee sees its end: the tarball gets the whole log)
wait "$TEE_PID" 2>/dev/null || true
publish final
exit "$rc"
