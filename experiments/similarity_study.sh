#!/usr/bin/env bash
# Similarity maps over training for the GPT-2, BERT and DeiT tiny presets (about 12 minutes on a
# 2-core CPU): trains each baseline with model snapshots every 50 steps, then writes
# results/similarity/<model>/{similarity.csv, summary.csv, layers.png, heads.png, trend.png} (linear CKA of
# features) and results/similarity/<model>-attention/ (Jensen-Shannon divergence of attention rows).
# notebooks/similarity_maps.ipynb reads these files. A finished training run is reused (--skip-done), a
# killed one resumes; to train anew, delete results/similarity/<model>-run first (--overwrite refuses to
# delete committed results).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
for model in gpt2 bert deit; do
  run=results/similarity/${model}-run
  mlresearch run experiments/configs/${model}_tiny.yaml --method baseline --out "$run" --resume --skip-done \
    --set train.keep_snapshots=true --set train.checkpoint_every=50
  mlresearch similarity --run "$run" --metric cka --out results/similarity/${model} --overwrite
  mlresearch similarity --run "$run" --metric attention --out results/similarity/${model}-attention --overwrite
done
