#!/usr/bin/env bash
# The GPU suite. Its first lines are the decisive table: the walk against PrefixGrouper and dense + gradient
# checkpointing on three configurations, each (configuration, method) in its own process, so an out-of-memory
# error is one row that says OOM and never reaches the next. Then fp32 gradient parity, a profile of one walk and
# one dense step, and the older steps while the deadline allows; everything lands in OUT_DIR, tarred into one file.
#
# The device command (one lent GPU, one call of at most 10 minutes; carry [".whl"]; .whl/ holds the
# prefix-grouper wheel: `pip download --no-deps prefix-grouper==0.0.1.post1 -d .whl`):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/gpu.sh /tmp/gpu-suite
#
# It leaves /tmp/gpu-suite/, /tmp/gpu-suite.tgz beside it and, since the device tool sets $OUT (which returns at
# most 8 files), copies into $OUT the tarball, gpu_table.md and gpu_sh.log. Other forms:
#
#   bash benchmarks/gpu.sh [OUT_DIR]            # a CUDA machine (default OUT_DIR: benchmarks/out/gpu)
#   bash benchmarks/gpu.sh --dry-run [OUT_DIR]  # any machine: the same steps on the CPU at toy sizes (~6 min)
#   PYTHON=.venv-gpu/bin/python bash benchmarks/gpu.sh --dry-run /tmp/gpu-dry   # in the GPU machine's packages
#
# Written for the project's CUDA machine: one H200, torch 2.11 + CUDA 13, transformers 5.17, accelerate 1.15, no
# TRL, no datasets, no flash-attn, no internet. prefix-grouper comes from $WHEELS (default .whl/: a
# prefix_grouper-*.whl, and a flash_attn-*.whl if one built for that torch is there; keep .whl/ out of git with
# .git/info/exclude) unless it is importable already (the device command above installs it); trl_dta is used
# from this checkout (PYTHONPATH), not installed. That machine's torch 2.11 is below the supported floor
# (torch>=2.13, pyproject.toml): the suite runs there anyway and says so in env.txt.
# Budget: the whole run fits one device command: each step gets at most what is left of DEADLINE_S (default 540
# s, counted from the start) and is skipped, with a line saying so (and its name in OUT_DIR/skipped.txt), when
# less than its minimum is left; steps run by priority, so a short loan loses the least needed.
#
# Steps, in order (GPU; the dry run runs the same on the CPU, smaller):
#   1. the decisive table (`gpu_table.py`, at most TABLE_BUDGET=300 s): Qwen3-0.6B grpo-4k-g16, Qwen3-1.7B
#      tau2-2x8-10k x1/8, Qwen3-0.6B tau2-2x8-10k; per configuration the walk (TreeExecutor's defaults),
#      PrefixGrouper, dense + gradient checkpointing in micro-batches of 2 rows, TRL's per-segment packing where
#      TRL imports (else "n/a (no TRL)"); bf16, sdpa, random weights; per row the median step (after a warm-up),
#      its ratio to dense + ckpt, the process's CUDA peak beside the plan's estimate, the walk's share of its
#      ideal (speedup / token dedup ratio); a row that cannot fit the budget says "skipped (deadline)". The dry
#      run: the first configuration, the tiny model, lengths x1/32, plus an injected OOM row (`--inject_oom`);
#   2. the plan: `peers.py --plan` (shapes, and every method's estimated peak against this card's memory);
#      environment: versions, the GPU, `import trl_dta` without TRL;
#   3. parity: `peers.py --parity` (fp32, TF32 off): every method's gradients against dense on tiny random
#      tries, plus the executor's chunked-backward and unpacked-leaves paths; fails the script on a mismatch;
#   4. profile (`gpu_profile.py`, ~1 min): one walk and one dense + ckpt step of Qwen3-0.6B on grpo-4k-g16 x1/4
#      under torch.profiler: GPU busy vs idle, GPU time by kind, host time per decoder-layer call;
#   5. the cost model fitted on this GPU (issue 41): `call_costs.py --device cuda`, then `cost_fit.py`;
#   6. the device-sized walk: `device_walk.py` (flex attention's fp32 exactness, failing the script above 1e-5;
#      then a Qwen3-1.7B-shaped walk on tau2-2x8-10k x1/8: its attention paths side by side: segments (the
#      default: the flash kernel), segments through sdpa, the mask path and flex);
#   7. FSDP2 smoke test: `fsdp2_smoke.py`, gather-once and per-layer (world size 1, fp32); fails the script on a
#      mismatch;
#   8. memory next to a colocated vLLM engine (issue 33): `vllm_memory.py`, on paper and the CUDA peaks;
#   9. soak (optional): `soak.py --mode executor`, 200 walks with an injected out-of-memory retry;
#  10. the GPU plan on paper: `launch_model.py` (CPU-side counts; any CPU runs it too), last;
# then the decisive table again (the device tool returns only the tail of a command's output), the exit codes,
# and the tarball.
# Outputs (OUT_DIR): gpu_table.md, gpu_table.json, gpu_table_rows/, plan.txt, env.txt, install.log, parity.json,
# parity.log, gpu_profile.md, gpu_profile.json, call_costs_cuda.json, cost_fit_cuda.json, cost_fit.log,
# flex_parity.json, device_walk.json, device_walk.log, fsdp2_smoke*.json, fsdp2_smoke.log, vllm_memory_paper.json,
# vllm_memory.json, vllm_memory.log, soak*, launch_model.json, launch_model.log, skipped.txt, gpu_sh.log; and
# OUT_DIR.tgz beside OUT_DIR (or $TGZ).
set -euo pipefail
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
DEADLINE_S="${DEADLINE_S:-$([ $DRY = 1 ] && echo 3600 || echo 540)}"  # (a dry run on a CPU: an hour)
TABLE_BUDGET="${TABLE_BUDGET:-$([ $DRY = 1 ] && echo 900 || echo 300)}"
PARITY_TIMEOUT="${PARITY_TIMEOUT:-120}"
STARTED=$SECONDS
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/gpu_sh.log"
exec 4>&1 5>&2 > >(tee -a "$OUT_DIR/gpu_sh.log") 2>&1  # (4, 5: the console, for the end)
TEE_PID=$!
exec 3>&1  # (the script's stdout: a step's own lines go there, not through its pipeline's tail)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $DRY = 1 ]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # (a shared CPU: the scripts without a --threads flag too)
fi
PEERS=benchmarks/peers.py

# ---- offline installs (only what is missing) and the scripts' syntax, quietly: the table's lines come first
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
    benchmarks/device_walk.py benchmarks/vllm_memory.py benchmarks/cost_fit.py benchmarks/call_costs.py
bash -n "${BASH_SOURCE[0]}"
if [ $DRY = 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device (use --dry-run on CPU)')"
fi

: > "$OUT_DIR/skipped.txt"  # (steps run inside pipelines, in subshells: what they skip goes to a file)
left() { echo $((DEADLINE_S - (SECONDS - STARTED))); }
step() {  # step NAME MIN_S MAX_S COMMAND...: run COMMAND under timeout min(MAX_S, what is left); its exit code
    local name=$1 min=$2 max=$3
    shift 3
    local budget
    budget=$(left)
    if [ "$budget" -lt "$min" ]; then
        echo "== $name: skipped (${budget}s left of DEADLINE_S=${DEADLINE_S}, it needs ${min}s)" >&3
        echo "$name" >> "$OUT_DIR/skipped.txt"
        return 0
    fi
    [ "$budget" -lt "$max" ] && max=$budget
    echo "== $name (at most ${max}s; $(left)s left)" >&3
    timeout "$max" "$@"
}

if [ $DRY = 1 ]; then
    DEVICE=cpu
    TABLE_ARGS=(--device cpu --model tiny --scale 0.03125 --configs 1 --inject_oom dense --threads 1)
else
    DEVICE=cuda
    TABLE_ARGS=(--device cuda)
fi

# ---- 1. the decisive table: a process per (configuration, method); its rows print as each configuration ends
# (not through `step`: its first line is the table's own)
table_rc=0
budget=$(( $(left) - 30 < TABLE_BUDGET ? $(left) - 30 : TABLE_BUDGET ))
timeout $((budget + 30)) "$PY" benchmarks/gpu_table.py "${TABLE_ARGS[@]}" --budget "$budget" --out "$OUT_DIR" \
    2>&1 | grep -v -i warn || table_rc=$?

# ---- 2. the plan (the memory estimate per method against this card) and the environment
echo "== gpu.sh $([ $DRY = 1 ] && echo '--dry-run ')-> $OUT_DIR ($(date -u +%FT%TZ)); the plan and the environment"
step "plan" 10 60 "$PY" "$PEERS" --profile gpu --device "$DEVICE" --micro_batch 2 --no_sweep \
    --methods dense,dense_ckpt,pg,tree_mask,tree --plan > "$OUT_DIR/plan.txt" 2>&1 \
    && grep -A30 "^peak memory" "$OUT_DIR/plan.txt" | head -n 26 || echo "plan: failed (not fatal)"
step "environment" 10 60 "$PY" - <<'PY' 2>&1 | tee "$OUT_DIR/env.txt" || echo "environment: failed (not fatal)"
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
print("gpu:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
import re
floor = re.search(r'"torch>=([0-9]+)\.([0-9]+)', open("pyproject.toml").read())
have = re.match(r"([0-9]+)\.([0-9]+)", torch.__version__)
if floor and have and tuple(map(int, have.groups())) < tuple(map(int, floor.groups())):
    print(f"note: torch {torch.__version__} is below the supported floor, torch>={'.'.join(floor.groups())} "
          "(pyproject.toml): this suite runs anyway, untested by CI at this version")
PY
[ $DRY = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT_DIR/env.txt" \
    || true
ATTN=sdpa
"$PY" -c "import flash_attn" 2>/dev/null && ATTN=sdpa,flash_attention_2

# ---- 3. parity (fp32): a failure fails the script, after the other steps have run
parity_rc=0
if [ $DRY = 1 ]; then
    step "parity, fp32, cpu" 60 600 "$PY" "$PEERS" --parity --device cpu --attn sdpa --threads 1 --out "$OUT_DIR" \
        2>&1 | tee "$OUT_DIR/parity.log" | grep -v -i warn | tail -n 28 || parity_rc=$?
else
    step "parity, fp32, cuda ($ATTN)" 60 "$PARITY_TIMEOUT" "$PY" "$PEERS" --parity --device cuda --attn "$ATTN" \
        --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/parity.log" | grep -v -i warn | tail -n 40 || parity_rc=$?
fi

# ---- 4. profile: one walk and one dense + ckpt step under torch.profiler; not fatal
if [ $DRY = 1 ]; then
    PROFILE_ARGS=(--device cpu --model tiny --scale 0.03125 --threads 1)
else
    PROFILE_ARGS=(--device cuda --model qwen3-0.6b --scale 0.25)
fi
step "profile: a walk and a dense + ckpt step, grpo-4k-g16" 30 75 "$PY" benchmarks/gpu_profile.py \
    "${PROFILE_ARGS[@]}" --out "$OUT_DIR" 2>&1 | grep -v -i "warn\|profiler_st" | tail -n 8 \
    || echo "profile: failed (not fatal)"

# ---- 5.-10. the older steps, while the deadline allows
walk_rc=0
fsdp_rc=0
if [ $DRY = 1 ]; then
    step "cost model fitted online on CPU (smoke: 2 layers, 3 steps)" 30 600 "$PY" benchmarks/cost_fit.py \
        --device cpu --hidden 72 --layers 2 --steps 3 --compare 1 --threads 1 --offline docs/call-costs-cpu.json \
        --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/cost_fit.log" | grep -v -i warn | tail -n 4
    step "device-sized walk on CPU (smoke: 1 layer, lengths x 1/32, sdpa only)" 30 600 "$PY" \
        benchmarks/device_walk.py --device cpu --layers 1 --scale 0.03125 --repeats 1 --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/device_walk.log" | grep -v -i warn | tail -n 2 || walk_rc=$?
    for mode in "" --per_layer; do
        step "FSDP2 smoke test on CPU (gloo, world size 1) ${mode:-gather-once}" 30 300 "$PY" \
            benchmarks/fsdp2_smoke.py --device cpu --hidden 256 --layers 4 $mode --out "$OUT_DIR" 2>&1 \
            | tee -a "$OUT_DIR/fsdp2_smoke.log" | grep -v -i warn | tail -n 15 || fsdp_rc=$?
    done
    echo "== vLLM memory: on paper, then the measuring code on CPU (1 layer, lengths x 1/50; no peaks on CPU)"
    "$PY" benchmarks/vllm_memory.py --paper --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/vllm_memory.log" | tail -n 8
    step "vLLM memory on CPU" 30 300 "$PY" benchmarks/vllm_memory.py --device cpu --layers 1 --scale 0.02 \
        --out "$OUT_DIR" 2>&1 | tee -a "$OUT_DIR/vllm_memory.log" | grep -v -i warn | tail -n 2
    step "soak on CPU (optional: 20 steps)" 30 300 "$PY" benchmarks/soak.py --mode executor --device cpu --steps 20 \
        --every 5 --warmup 5 --oom_at 8 --hidden 64 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/soak.log" \
        | grep -v -i warn | tail -n 3 || echo "soak: failed (not fatal)"
    step "launch model on CPU (lengths x 1/8, 60e9 B, segments, mask and flex)" 30 900 "$PY" benchmarks/launch_model.py \
        --scales 0.125 --cards "" --launch_factors 2 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/launch_model.log" \
        | grep -v -i warn | tail -n 2
else
    # 5. the cost model fitted on this GPU (issue 41): the offline fit, then the online fit; not fatal
    step "call costs on this GPU (the offline fit)" 45 150 "$PY" benchmarks/call_costs.py --device cuda \
        --hidden 1152 --layers 8 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/cost_fit.log" | grep -v -i warn \
        | tail -n 5 || echo "call costs: failed (not fatal)"
    step "cost model fitted online on this GPU" 60 240 "$PY" benchmarks/cost_fit.py --device cuda --hidden 1152 \
        --layers 8 --memory 60e9 --steps 12 --offline "$OUT_DIR/call_costs_cuda.json" --peers --out "$OUT_DIR" \
        2>&1 | tee -a "$OUT_DIR/cost_fit.log" | grep -v -i warn | tail -n 32 || echo "cost fit: failed (not fatal)"
    # 6. the device-sized walk (issue 27): flex's fp32 exactness (fails the script), then the Qwen3-1.7B walk
    step "device-sized walk, cuda (flex parity, then segments, segments via sdpa, mask, flex)" 90 240 "$PY" \
        benchmarks/device_walk.py --device cuda --scale 0.125 --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/device_walk.log" | grep -v -i warn | tail -n 8 || walk_rc=$?
    # 7. FSDP2 smoke test (fp32, world size 1)
    for mode in "" --per_layer; do
        step "FSDP2 smoke test, fp32, cuda ${mode:-gather-once}" 45 120 "$PY" benchmarks/fsdp2_smoke.py \
            --device cuda --hidden 2048 --layers 8 $mode --out "$OUT_DIR" 2>&1 \
            | tee -a "$OUT_DIR/fsdp2_smoke.log" | grep -v -i warn | tail -n 15 || fsdp_rc=$?
    done
    # 8. memory next to a colocated vLLM engine (issue 33), on paper and measured; not fatal
    "$PY" benchmarks/vllm_memory.py --paper --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/vllm_memory.log" | tail -n 8 \
        || echo "vllm memory on paper: failed (not fatal)"
    step "vLLM memory: walk vs dense + gradient checkpointing, cuda" 60 240 "$PY" benchmarks/vllm_memory.py \
        --device cuda --scale 1 --out "$OUT_DIR" 2>&1 | tee -a "$OUT_DIR/vllm_memory.log" | grep -v -i warn \
        | tail -n 3 || echo "vllm memory: failed (not fatal)"
    # 9. optional: soak (200 walks + SGD steps, an injected out-of-memory retry at step 60); not fatal
    step "soak, cuda (optional)" 60 150 "$PY" benchmarks/soak.py --mode executor --device cuda --steps 200 \
        --oom_at 60 --hidden 1024 --out "$OUT_DIR" --plot "$OUT_DIR/soak_executor.png" 2>&1 \
        | tee "$OUT_DIR/soak.log" | grep -v -i warn | tail -n 3 || echo "soak: failed (not fatal)"
    # 10. the GPU plan on paper (CPU-side counts: any CPU runs it too), last
    step "launch model (kernels and FLOPs per step, Qwen3-1.7B, tau2-2x8-10k)" 120 420 "$PY" \
        benchmarks/launch_model.py --scales 0.125 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/launch_model.log" \
        | grep -v -i warn | tail -n 16 || echo "launch model: failed (not fatal)"
fi

# ---- the decisive table again (the device tool returns the tail of the output), the exit codes, the tarball
echo
cat "$OUT_DIR/gpu_table.md" 2>/dev/null || echo "(no decisive table: see gpu_sh.log)"
echo "== table exit $table_rc, parity exit $parity_rc, FSDP2 smoke exit $fsdp_rc, device walk exit $walk_rc" \
    "($(date -u +%FT%TZ), $((SECONDS - STARTED)) s); skipped for the deadline: $(wc -l < "$OUT_DIR/skipped.txt")" \
    "step(s) $(tr '\n' ';' < "$OUT_DIR/skipped.txt")"
echo "== $([ $DRY = 1 ] && echo 'dry run done; ')outputs in $OUT_DIR, tarred into $TGZ"
exec 1>&4 2>&5 3>&-  # (the log's tee sees its end: the tarball gets the whole log)
wait "$TEE_PID" 2>/dev/null || true
tar -czf "$TGZ" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$(cd "$OUT" && pwd)" != "$(cd "$OUT_DIR" && pwd)" ]; then
    cp "$TGZ" "$OUT_DIR/gpu_table.md" "$OUT_DIR/gpu_sh.log" "$OUT"/ 2>/dev/null || true
fi
[ "$table_rc" = 0 ] || exit "$table_rc"
[ "$parity_rc" = 0 ] || exit "$parity_rc"
[ "$fsdp_rc" = 0 ] || exit "$fsdp_rc"
exit "$walk_rc"
