#!/usr/bin/env bash
# One short check on a CUDA machine, before anyone spends GPU-hours on a paper preset (about 10 minutes
# on one H100-class GPU; CPU tests stay the CI). Prints, for each step, what it measured:
#   1. the smoke presets of every task in bf16, eager and torch.compile'd (loss must match within bf16);
#   2. a GPT-2-124M-shaped model (12L/768d, 512 tokens, GPT-2's vocabulary) for a few hundred steps in bf16
#      with torch.compile: tokens/s, MFU (against the device's dense bf16 peak) and peak memory;
#   3. a V-cycle of the same shape for a few hundred steps in all (coalesce, small model, de-coalesce, merge);
#   4. with 2+ GPUs: the GPT-2 smoke V-cycle under FSDP (torchrun, NCCL), against one GPU;
#   5. the GPT-2 CPU study's small and full shapes, eager and under each execution train.speed can choose: GFLOP/s, MFU.
#     bash experiments/gpu_check.sh [OUT_DIR]        (default /tmp/mlresearch-gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
out=${1:-/tmp/mlresearch-gpu-check}
mkdir -p "$out"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16 {torch.cuda.is_bf16_supported()}")
PY
summary() {  # one line per run: final loss, tokens/s, MFU and peak memory from its metrics
  python - "$@" <<'PY'
import json, sys
for run in sys.argv[1:]:
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if l.strip()]
    steps = [r for r in rows if "train_loss" in r]
    last = steps[-1]
    mfu = [r["mfu"] for r in steps[1:] if "mfu" in r]  # the first row carries compilation
    mem = max((r.get("max_memory_gb", 0) for r in steps), default=0)
    tps = (last["tokens"] - steps[0]["tokens"]) / max(last["wall"] - steps[0]["wall"], 1e-9)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    print(f"{run.split('/')[-1]:28} steps {last['step']:>5}  train loss {last['train_loss']:.4f}  "
          f"val {val[-1] if val else float('nan'):.4f}  tokens/s {tps:,.0f}  "
          f"MFU {sum(mfu) / len(mfu) if mfu else float('nan'):.3f}  peak memory {mem:.2f} GB")
PY
}
one=(--set train.threads=null)
echo "== 1. smoke presets, bf16, eager and compiled"
for p in gpt2 bert llama deit; do
  mlresearch run "experiments/configs/${p}_smoke.yaml" --method baseline --out "$out/${p}-bf16" --overwrite \
    --set train.bf16=true "${one[@]}"
  mlresearch run "experiments/configs/${p}_smoke.yaml" --method baseline --out "$out/${p}-bf16-compiled" --overwrite \
    --set train.bf16=true --set train.compile=true "${one[@]}"
  summary "$out/${p}-bf16" "$out/${p}-bf16-compiled"
done
echo "== 2. GPT-2-124M shape, bf16 + compile"
big=(--set model.layers=12 --set model.heads=12 --set model.hidden=768 --set data.tokenizer=gpt2 --set data.seq_len=512
     --set train.batch_size=32 --set train.lr=0.0006 --set train.warmup=30 --set train.bf16=true --set train.compile=true
     --set train.log_every=25 --set train.eval_every=300 --set train.eval_batches=4 --set train.checkpoint_every=100000
     "${one[@]}")
mlresearch run experiments/configs/gpt2_tiny.yaml --method baseline --out "$out/gpt2-124m" --overwrite "${big[@]}" \
  --set train.steps=300
summary "$out/gpt2-124m"
echo "== 3. V-cycle of the same shape on the GPU"
mlresearch run experiments/configs/gpt2_tiny.yaml --method vcycle --out "$out/gpt2-124m-vcycle" --overwrite "${big[@]}" \
  --set train.steps=300 --set vcycle.down_steps=[30] --set vcycle.small_steps=150 --set vcycle.up_steps=[120] \
  --set vcycle.lr=[0.0006,0.0012]
summary "$out/gpt2-124m-vcycle"
grep -h '"interpolated"' "$out/gpt2-124m-vcycle/metrics.jsonl" || true
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  echo "== 4. FSDP on 2 GPUs (the smoke V-cycle, optimizer carried) against 1 GPU"
  mlresearch run experiments/configs/gpt2_smoke.yaml --method vcycle --out "$out/fsdp-1gpu" --overwrite --set vcycle.optimizer=carry
  torchrun --nproc_per_node 2 -m mlresearch.cli run experiments/configs/gpt2_smoke.yaml --method vcycle --out "$out/fsdp-2gpu" \
    --overwrite --set vcycle.optimizer=carry --set train.fsdp=true
  summary "$out/fsdp-1gpu" "$out/fsdp-2gpu"
else
  echo "== 4. FSDP: skipped ($gpus GPU; it needs 2)"
fi
echo "== 5. small phases at full speed: every gpt2_regime shape, eager and each execution train.speed can choose"
echo "   (compiled or not, fused AdamW or not): GFLOP/s, MFU, the fastest over the full shape's eager rate"
python experiments/bench_shapes.py experiments/studies/gpt2_regime.yaml --steps 30 --warmup 5 --repeats 2 --executions \
  --table "$out/step_time-gpt2_regime.csv"
echo "gpu check done: $out"
