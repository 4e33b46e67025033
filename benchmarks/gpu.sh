#!/usr/bin/env bash
# The GPU suite: fp32 gradient parity on the device, then the peer benchmark in bf16, tables to an output folder.
#
#   bash benchmarks/gpu.sh [OUT_DIR]            # on a CUDA machine (default OUT_DIR: $OUT, else benchmarks/out/gpu)
#   bash benchmarks/gpu.sh --dry-run [OUT_DIR]  # on any machine: checks the plan, runs the smallest config on CPU
#
# Written for the project's CUDA machine: one H200, torch 2.11 + CUDA, transformers 5.17, no TRL, no datasets,
# no internet. It installs what it needs, offline, from the wheels in $WHEELS (default .whl/ at the repository
# root: prefix_grouper-*.whl, and a flash_attn-*.whl if one built for that torch is there; keep .whl/ out of
# git with .git/info/exclude and name it in the device tool's `carry`); trl_dta is used from this checkout
# (PYTHONPATH), not installed.
# Budget: the whole run fits one device command (at most 10 minutes, of a 15-minute loan that its start-up
# also spends): each step on the GPU gets at most what is left of DEADLINE_S (default 540 s) and is skipped,
# with a line saying so (and its name in OUT_DIR/skipped.txt), when less than its minimum is left; the steps
# run by priority, so what a short loan leaves out is the least needed.
# That machine's torch 2.11 is below the supported floor (torch>=2.13, pyproject.toml, the version CI tests): the
# suite runs there anyway, prints a note saying so in its environment step, and does not fail for it.
#
# Steps, in order:
#   1. install prefix-grouper (and flash-attn) from $WHEELS with --no-index --no-deps, if not importable yet;
#   2. environment: versions, the GPU, `import trl_dta` stays cheap and needs no TRL for the executor path;
#   3. parity: `peers.py --parity` (fp32, TF32 off): every method's gradients against dense on tiny random
#      tries, plus the executor's chunked-backward and unpacked-leaves paths; fails the script on a mismatch;
#   4. the cost model fitted on this GPU (issue 41): `call_costs.py --device cuda` (the offline fit), then
#      `cost_fit.py --device cuda`: the fitted constants, the plan before and after calibration, predicted
#      against measured walk times, from the shipped constants and from their launch cost x4; ~2 min;
#   5. the device-sized walk: `device_walk.py` (flex attention's fp32 exactness on random tries, failing the
#      script above 1e-5; then a Qwen3-1.7B-shaped walk with memory_budget="auto", sdpa, sdpa split per
#      segment (launch_model.py's what-if) and flex side by side: budgets, calls, walk vs dense, CUDA peak,
#      recompute, host syncs per walk); ~2-3 min;
#   6. benchmark: `peers.py --profile gpu` (Qwen3-0.6B then 1.7B shapes, random weights, bf16, sdpa and
#      flash-attn if installed, 4k-16k contexts, torch.cuda.max_memory_allocated), tables in OUT_DIR; it stops
#      starting configurations when its budget (BENCH_BUDGET, or what the deadline leaves) is spent;
#   7. FSDP2 smoke test: `fsdp2_smoke.py`, gather-once and per-layer (world size 1, fp32: the walk on a
#      fully_shard-ed model against dense gradients, FSDP2's gathers and reductions per walk, the walk's CUDA
#      peak against docs/multi-process.md's memory model); ~1 min; fails the script on a mismatch;
#   8. memory next to a colocated vLLM engine (issue 33): `vllm_memory.py`, the CUDA peaks of the walk (block and
#      calls 2048) and of dense + gradient checkpointing (TRL's micro-batches of 8, a chunked LM head) on the
#      Qwen3-1.7B tau2-2x8-10k step, beside its model on paper (docs/vllm.md: the KV cache the difference
#      leaves vLLM); ~1-2 min; not fatal. vLLM itself is not on that machine (its CUDA wheel is far over what a
#      call carries), so the colocated engine's sleep/wake is not run there;
#   9. soak (optional, not fatal): `soak.py --mode executor`, 200 walks with an injected out-of-memory retry;
#  10. the GPU plan on paper: `launch_model.py` (kernels and FLOPs per step, walk vs dense, for Qwen3-1.7B on
#      the tau2-2x8-10k shape; the plan built with the shipped constants beside the calibrated one where
#      launches cost 0.5-4x, and the bound on any plan of that attention kernel); ~3 min, CPU only (any CPU
#      runs it too), so it comes last.
# Outputs (OUT_DIR): env.txt, parity.json, parity.log, call_costs_cuda.json, cost_fit_cuda.json, cost_fit.log,
# flex_parity.json, device_walk.json, device_walk.log, peers_gpu.json, peers_gpu.md, peers_gpu.log, the plots
# peers_gpu_speedup.png and peers_gpu_memory.png, fsdp2_smoke*.json, fsdp2_smoke.log, vllm_memory_paper.json,
# vllm_memory.json, vllm_memory.log, soak*, launch_model.json, launch_model.log, skipped.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
OUT_DIR="${1:-${OUT:-benchmarks/out/gpu}}"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"
PARITY_TIMEOUT="${PARITY_TIMEOUT:-120}"
BENCH_BUDGET="${BENCH_BUDGET:-240}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-330}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PEERS=benchmarks/peers.py

echo "== gpu.sh $([ $DRY = 1 ] && echo '--dry-run ')-> $OUT_DIR ($(date -u +%FT%TZ))"

# ---- 1. offline installs (only what is missing)
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
install_wheel prefix_grouper 'prefix_grouper-*.whl' || { echo "prefix-grouper is required (pip download prefix-grouper==0.0.1.post1 -d .whl)"; exit 1; }
install_wheel flash_attn 'flash_attn-*.whl' || echo "flash-attn: not installed, sdpa only"

# ---- 2. environment and the plan
for f in "$PEERS" benchmarks/common.py benchmarks/peer_bench/__init__.py; do
    test -f "$f" || { echo "missing $f"; exit 1; }
done
"$PY" -m py_compile "$PEERS" benchmarks/common.py benchmarks/peer_bench/*.py benchmarks/fsdp2_smoke.py \
    benchmarks/launch_model.py benchmarks/device_walk.py benchmarks/vllm_memory.py benchmarks/cost_fit.py \
    benchmarks/call_costs.py
bash -n "${BASH_SOURCE[0]}"
"$PY" - <<'PY' | tee "$OUT_DIR/env.txt"
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

# The whole run must fit one device command (10 minutes) of a 15-minute loan: every step below runs under
# `step`, which gives it at most what is left of $DEADLINE_S (counted from here) and skips it, saying so, when
# less than its minimum is left. Steps run by priority: the proof of exactness, then the cost model fitted on
# this GPU (issue 41), the device-sized walk, the peer benchmark; the rest where time is left.
DEADLINE_S="${DEADLINE_S:-$([ $DRY = 1 ] && echo 3600 || echo 540)}"  # (a dry run on a CPU: an hour)
STARTED=$SECONDS
: > "$OUT_DIR/skipped.txt"  # (steps run inside pipelines, in subshells: what they skip goes to a file)
exec 3>&1  # (the script's stdout: a step's own lines go there, not through its pipeline's tail)
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
    # The GPU profile's plan (configurations, shapes, sizes, position range), then the smallest configuration
    # end to end on this CPU: the tiny model on the GPU shapes scaled down, in bf16 (the GPU dtype) and fp32
    # parity; every method, gradients checked, tables and plots written.
    echo "== plan (profile gpu)"
    "$PY" "$PEERS" --profile gpu --device cpu --plan
    echo "== parity, fp32, on CPU"
    "$PY" "$PEERS" --parity --device cpu --attn sdpa --threads 1 --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/parity.log" | grep -v -i warn | tail -n 28
    echo "== FSDP2 smoke test on CPU (gloo, world size 1)"
    for mode in "" --per_layer; do
        "$PY" benchmarks/fsdp2_smoke.py --device cpu --hidden 256 --layers 4 $mode --out "$OUT_DIR" 2>&1 \
            | tee -a "$OUT_DIR/fsdp2_smoke.log" | grep -v -i warn | tail -n 15
    done
    echo "== soak on CPU (optional: benchmarks/soak.py --mode executor, 20 steps)"
    "$PY" benchmarks/soak.py --mode executor --device cpu --steps 20 --every 5 --warmup 5 --oom_at 8 --hidden 64 \
        --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/soak.log" | grep -v -i warn | tail -n 3 || echo "soak: failed (not fatal)"
    echo "== launch model on CPU (lengths x 1/8, 60e9 B, flex and sdpa)"
    "$PY" benchmarks/launch_model.py --scales 0.125 --cards "" --launch_factors 2 --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/launch_model.log" | grep -v -i warn | tail -n 2
    step "cost model fitted online on CPU (smoke: 2 layers, 3 steps)" 30 600 "$PY" benchmarks/cost_fit.py \
        --device cpu --hidden 72 --layers 2 --steps 3 --compare 1 --threads 1 --offline docs/call-costs-cpu.json \
        --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/cost_fit.log" | grep -v -i warn | tail -n 4
    echo "== device-sized walk on CPU (smoke: 1 layer, lengths x 1/32, sdpa only)"
    "$PY" benchmarks/device_walk.py --device cpu --layers 1 --scale 0.03125 --repeats 1 --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/device_walk.log" | grep -v -i warn | tail -n 2
    echo "== vLLM memory: on paper, then the measuring code on CPU (1 layer, lengths x 1/50; no peaks on CPU)"
    "$PY" benchmarks/vllm_memory.py --paper --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/vllm_memory.log" | tail -n 8
    "$PY" benchmarks/vllm_memory.py --device cpu --layers 1 --scale 0.02 --out "$OUT_DIR" 2>&1 \
        | tee -a "$OUT_DIR/vllm_memory.log" | grep -v -i warn | tail -n 2
    echo "== smallest configuration on CPU (tiny model, the GPU profile's first shape x 1/32, bf16, 1 repeat)"
    "$PY" "$PEERS" --profile gpu --device cpu --models tiny --attn sdpa --dtype bfloat16 --scale 0.03125 \
        --shapes grpo-4k-g16 --no_sweep --repeats 1 --threads 1 --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/peers_gpu.log" | grep -v -i warn | tail -n 12
    echo "== dry run passed; outputs in $OUT_DIR"
    exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device (use --dry-run on CPU)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT_DIR/env.txt" || true
ATTN=sdpa
"$PY" -c "import flash_attn" 2>/dev/null && ATTN=sdpa,flash_attention_2

# ---- 3. parity (fp32)
parity_rc=0  # a parity failure fails the script, after the other steps have run (their own checks say more)
step "parity, fp32, cuda ($ATTN)" 60 "$PARITY_TIMEOUT" "$PY" "$PEERS" --parity --device cuda --attn "$ATTN" \
    --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/parity.log" | grep -v -i warn | tail -n 40 || parity_rc=$?

# ---- 4. the cost model fitted on this GPU (issue 41): the offline fit of call_costs.py, then the online fit
# from the shipped constants and from their launch cost x4; prints the fitted constants, the plan before and
# after calibration, and predicted against measured walk times, on random steps and on peers.py's GPU shapes
# (cost_fit_cuda.json); not fatal
step "call costs on this GPU (the offline fit)" 45 150 "$PY" benchmarks/call_costs.py --device cuda --hidden 1152 \
    --layers 8 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/cost_fit.log" | grep -v -i warn | tail -n 5 \
    || echo "call costs: failed (not fatal)"
step "cost model fitted online on this GPU" 60 240 "$PY" benchmarks/cost_fit.py --device cuda --hidden 1152 \
    --layers 8 --memory 60e9 --steps 12 --offline "$OUT_DIR/call_costs_cuda.json" --peers --out "$OUT_DIR" \
    2>&1 | tee -a "$OUT_DIR/cost_fit.log" | grep -v -i warn | tail -n 32 || echo "cost fit: failed (not fatal)"

# ---- 5. the device-sized walk (issue 27): flex's fp32 exactness on random tries (fails the script), then the
# Qwen3-1.7B-shaped walk with memory_budget="auto" on tau2-2x8-10k x 1/8, sdpa, sdpa split per segment (the
# what-if) and flex side by side: budgets, calls, walk vs dense time, CUDA peak, recompute, gradients against
# sdpa's, host syncs per walk; ~2-3 min
walk_rc=0
step "device-sized walk, cuda (flex parity, then sdpa, sdpa split, flex)" 90 240 "$PY" benchmarks/device_walk.py \
    --device cuda --scale 0.125 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/device_walk.log" | grep -v -i warn \
    | tail -n 8 || walk_rc=$?

# ---- 6. the peer benchmark (bf16): stops starting configurations when its budget is spent
rc=0
bench=$(( $(left) - 60 < BENCH_BUDGET ? $(left) - 60 : BENCH_BUDGET ))
step "peer benchmark, bf16, cuda ($ATTN), budget ${bench}s" 120 "$BENCH_TIMEOUT" "$PY" "$PEERS" --profile gpu \
    --attn "$ATTN" --time_budget "$bench" --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/peers_gpu.log" \
    | grep -v -i warn | tail -n 80 || rc=$?

# ---- 7. FSDP2 smoke test (fp32, world size 1)
fsdp_rc=0
for mode in "" --per_layer; do
    step "FSDP2 smoke test, fp32, cuda ${mode:-gather-once}" 45 120 "$PY" benchmarks/fsdp2_smoke.py --device cuda \
        --hidden 2048 --layers 8 $mode --out "$OUT_DIR" 2>&1 | tee -a "$OUT_DIR/fsdp2_smoke.log" \
        | grep -v -i warn | tail -n 15 || fsdp_rc=$?
done

# ---- 8. memory next to a colocated vLLM engine (issue 33): walk vs dense + checkpointing CUDA peaks on the
# Qwen3-1.7B tau2 step, beside the model on paper (the KV cache the difference leaves vLLM: docs/vllm.md)
"$PY" benchmarks/vllm_memory.py --paper --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/vllm_memory.log" | tail -n 8 \
    || echo "vllm memory on paper: failed (not fatal)"
step "vLLM memory: walk vs dense + gradient checkpointing, cuda" 60 240 "$PY" benchmarks/vllm_memory.py \
    --device cuda --scale 1 --out "$OUT_DIR" 2>&1 | tee -a "$OUT_DIR/vllm_memory.log" | grep -v -i warn \
    | tail -n 3 || echo "vllm memory: failed (not fatal)"

# ---- 9. optional: soak (benchmarks/soak.py --mode executor: 200 walks + SGD steps on tries of changing shapes, an
# injected out-of-memory retry at step 60; CUDA allocated / max allocated / reserved every 10 steps, in
# soak_executor.json and soak_executor.png); ~1 min; a failure is reported, not fatal
step "soak, cuda (optional)" 60 150 "$PY" benchmarks/soak.py --mode executor --device cuda --steps 200 --oom_at 60 \
    --hidden 1024 --out "$OUT_DIR" --plot "$OUT_DIR/soak_executor.png" 2>&1 | tee "$OUT_DIR/soak.log" \
    | grep -v -i warn | tail -n 3 || echo "soak: failed (not fatal)"

# ---- 10. the GPU plan on paper (CPU-side counts, needing no GPU: `--dry-run` and any CPU run it too; the
# benchmark's tau2 row measures what it predicts)
step "launch model (kernels and FLOPs per step, Qwen3-1.7B, tau2-2x8-10k)" 120 420 "$PY" benchmarks/launch_model.py \
    --scales 0.125 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/launch_model.log" | grep -v -i warn | tail -n 16 \
    || echo "launch model: failed (not fatal)"

ls -la "$OUT_DIR"
echo "== parity exit $parity_rc, FSDP2 smoke exit $fsdp_rc, device walk exit $walk_rc, benchmark exit $rc" \
    "($(date -u +%FT%TZ)); skipped for the deadline: $(wc -l < "$OUT_DIR/skipped.txt") step(s)"
cat "$OUT_DIR/skipped.txt"
[ "$parity_rc" = 0 ] || exit "$parity_rc"
[ "$fsdp_rc" = 0 ] || exit "$fsdp_rc"
[ "$walk_rc" = 0 ] || exit "$walk_rc"
exit "$rc"
