#!/usr/bin/env bash
# One short check on a CUDA machine, before anyone spends GPU-hours on a paper preset (about 9 minutes
# on one H200, 12 at most; CPU tests stay the CI). Every step runs under its own time limit and a failed
# step does not stop the next; each prints what it measured, then "-- STEP: rc N in S s":
#   1. a GPT-2-124M-shaped model (12L/768d, 512 tokens, GPT-2's vocabulary) in bf16 with torch.compile:
#      tokens/s, MFU (against the device's dense bf16 peak) and peak memory;
#   2. a V-cycle of the same shape, eager (coalesce, small model, de-coalesce, merge): the operators on a GPU,
#      and each phase's MFU (its first phase is the full shape eager, beside step 1's compiled);
#   3. small phases at full speed: the GPT-2 CPU study's full shape and its V-cycle's small shapes (1L/64d,
#      2L/32d), bf16, eager and compiled, with and without CUDA graphs and AdamW's fused kernel: GFLOP/s,
#      MFU, the small shape's rate over the full shape's eager rate; then the same for step 1's shape and its
#      V-cycle's small shape (12L/768d, 6L/384d);
#   4. the smoke presets of every task in bf16, eager; GPT-2's also compiled and compiled with CUDA graphs
#      (train.speed): the final losses must agree within bf16;
#   5. with 2+ GPUs: the GPT-2 smoke V-cycle under FSDP (torchrun, NCCL), against one GPU.
#     bash experiments/gpu_check.sh [OUT_DIR]        (default /tmp/mlresearch-gpu-check)
#     GPU_CHECK_DRY=1 bash experiments/gpu_check.sh  (every step at toy size on a CPU: the script's own check)
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
out=${1:-/tmp/mlresearch-gpu-check}
mkdir -p "$out"
py=$(command -v python || command -v python3)
ml=("$py" -m mlresearch.cli)
dry=${GPU_CHECK_DRY:-}
"$py" - "$dry" <<'PY' || exit 1
import sys, torch
if not sys.argv[1]:
    assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device (GPU_CHECK_DRY=1: a toy run on the CPU)"
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, bf16 {torch.cuda.is_bf16_supported()}")
else:
    print(f"dry run on the CPU, torch {torch.__version__}")
import datasets, transformers, timm, mlresearch
print(f"transformers {transformers.__version__}, timm {timm.__version__}, datasets {datasets.__version__}")
PY
step() {  # step NAME LIMIT_S COMMAND...: the command under a time limit; its status and seconds after it
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name"
  timeout --kill-after 10 "$limit" "$@"
  echo "-- $name: rc $? in $((SECONDS - start)) s"
}
summary() {  # per run and phase: final loss, tokens/s, MFU, peak memory; [--compare]: final losses against the first run's
  "$py" - "$@" <<'PY'
import json, sys
first, compare = None, sys.argv[1] == "--compare"
for run in sys.argv[1 + compare:]:
    try:
        rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if l.strip()]
    except OSError:
        print(f"{run.split('/')[-1]:28} no metrics"); continue
    for phase in dict.fromkeys(r.get("phase") for r in rows if "train_loss" in r):
        steps = [r for r in rows if "train_loss" in r and r.get("phase") == phase]
        last = steps[-1]
        mfu = [r["mfu"] for r in steps[1:] if "mfu" in r]  # the first row carries compilation
        mem = max((r.get("max_memory_gb", 0) for r in steps), default=0)
        tps = (last["tokens"] - steps[0]["tokens"]) / max(last["wall"] - steps[0]["wall"], 1e-9)
        print(f"{run.split('/')[-1]:28} {str(phase):12} steps {last['step']:>5}  train loss {last['train_loss']:.4f}  "
              f"tokens/s {tps:,.0f}  MFU {sum(mfu) / len(mfu) if mfu else float('nan'):.3f}  peak memory {mem:.2f} GB")
    try:
        val = json.load(open(f"{run}/summary.json"))["final_full_val"]["val_loss"]
    except (OSError, KeyError):
        continue
    first = val if first is None else first
    print(f"{run.split('/')[-1]:28} final validation loss {val:.4f}" + (f" (minus the first run's: {val - first:+.4f})"
                                                                         if compare else ""))
PY
}
one=(--set train.threads=null)
if [ -z "$dry" ]; then
  big=(--set model.layers=12 --set model.heads=12 --set model.hidden=768 --set data.tokenizer=gpt2 --set data.seq_len=512
       --set train.batch_size=32 --set train.lr=0.0006 --set train.warmup=30 --set train.bf16=true
       --set train.log_every=25 --set train.eval_every=300 --set train.eval_batches=4 --set train.checkpoint_every=100000)
  steps=200 cycle=(--set vcycle.down_steps=[20] --set vcycle.small_steps=100 --set vcycle.up_steps=[80])
  bench=(--steps 30 --warmup 5 --repeats 2 --shapes 1L/64d/2h,2L/32d/1h --set train.bf16=true --set train.threads=null)
  executions=eager,eager+fused,compiled+fused,compiled+graphs+fused
  base=(--shapes 6L/384d/6h --steps 20 --warmup 3 --repeats 1 --set model.layers=12 --set model.heads=12
        --set model.hidden=768 --set data.tokenizer=gpt2 --set data.seq_len=512 --set train.batch_size=32
        --set train.bf16=true --set train.threads=null)
else  # toy sizes: every step's plumbing, on a CPU
  big=(--set model.layers=2 --set model.heads=2 --set model.hidden=64 --set data.tokenizer=gpt2 --set data.seq_len=64
       --set train.batch_size=4 --set train.warmup=2 --set train.log_every=2 --set train.eval_every=300
       --set train.eval_batches=1 --set train.checkpoint_every=100000 --set data.max_documents=40)
  steps=8 cycle=(--set vcycle.down_steps=[2] --set vcycle.small_steps=4 --set vcycle.up_steps=[2])
  bench=(--steps 2 --warmup 1 --repeats 1 --shapes 2L/32d/1h)
  executions=eager,compiled+graphs+fused
  base=(--shapes 2L/32d/2h --steps 2 --warmup 1 --repeats 1 --set model.layers=4 --set model.heads=4 --set model.hidden=64
        --set data.tokenizer=gpt2 --set data.seq_len=64 --set train.batch_size=4 --set data.max_documents=40)
fi
step "1. GPT-2-124M shape, bf16, compiled" 130 "${ml[@]}" run experiments/configs/gpt2_tiny.yaml --method baseline \
  --out "$out/gpt2-124m-compiled" --overwrite "${big[@]}" --set train.steps=$steps --set train.compile=true "${one[@]}"
summary "$out/gpt2-124m-compiled"
step "2. V-cycle of the same shape, bf16, eager" 90 "${ml[@]}" run experiments/configs/gpt2_tiny.yaml --method vcycle \
  --out "$out/gpt2-124m-vcycle" --overwrite "${big[@]}" --set train.steps=$steps "${cycle[@]}" \
  --set vcycle.lr=[0.0006,0.0012] --set train.log_every=10 "${one[@]}"  # (rows in its 20-step first phase too)
summary "$out/gpt2-124m-vcycle"
grep -h '"interpolated"' "$out/gpt2-124m-vcycle/metrics.jsonl" 2>/dev/null || true
step "3. small phases at full speed: gpt2_regime's shapes, bf16, each execution (GFLOP/s, MFU)" 180 \
  "$py" experiments/bench_shapes.py experiments/studies/gpt2_regime.yaml "${bench[@]}" --executions "$executions" \
  --table "$out/step_time-gpt2_regime.csv"
step "3. the same at GPT-2-124M's V-cycle: 12L/768d and its 6L/384d small shape, bf16" 150 \
  "$py" experiments/bench_shapes.py experiments/configs/gpt2_tiny.yaml "${base[@]}" \
  --executions eager,compiled+fused,compiled+graphs+fused --table "$out/step_time-gpt2_124m.csv"
echo "== 4. smoke presets, bf16: every task eager; GPT-2 also compiled and compiled with CUDA graphs"
for p in gpt2 bert llama deit; do
  step "4. $p eager" 30 "${ml[@]}" run "experiments/configs/${p}_smoke.yaml" --method baseline --out "$out/${p}-bf16" \
    --overwrite --set train.bf16=true "${one[@]}"
done
for s in compiled compiled+graphs+fused; do
  step "4. gpt2 $s" 50 "${ml[@]}" run experiments/configs/gpt2_smoke.yaml --method baseline --out "$out/gpt2-bf16-$s" \
    --overwrite --set train.bf16=true --set train.speed=$s "${one[@]}"
done
summary "$out"/{gpt2,bert,llama,deit}-bf16
summary --compare "$out/gpt2-bf16" "$out/gpt2-bf16-compiled" "$out/gpt2-bf16-compiled+graphs+fused"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  step "5. FSDP on 2 GPUs (the smoke V-cycle, optimizer carried) against 1 GPU" 180 bash -c "
    ${ml[*]} run experiments/configs/gpt2_smoke.yaml --method vcycle --out $out/fsdp-1gpu --overwrite \
      --set vcycle.optimizer=carry &&
    torchrun --nproc_per_node 2 -m mlresearch.cli run experiments/configs/gpt2_smoke.yaml --method vcycle \
      --out $out/fsdp-2gpu --overwrite --set vcycle.optimizer=carry --set train.fsdp=true"
  summary "$out/fsdp-1gpu" "$out/fsdp-2gpu"
else
  echo "== 5. FSDP: skipped ($gpus GPU; it needs 2)"
fi
echo "gpu check done: $out"
