#!/usr/bin/env bash
# Training step against link rate on 2 virtual nodes x 2 ranks (slurm/testing/virtual_cluster.sh):
# torch DDP (gloo and over the hpcddp backend), Horovod (when it imports), hpcddp's default, hpcddp with fp16 gradients and
# local SGD (parameters averaged every 4 steps). One JSON per rate in docs/across_nodes/, then
# the plot (docs/across_nodes.png). Needs root (network namespaces); ~10 minutes on 2 cores.
#
#   bash docs/across_nodes.sh [RATE...]        default: 500mbit 1gbit 2500mbit 10gbit
set -euo pipefail
cd "$(dirname "$0")/.."
rates=("$@")
((${#rates[@]})) || rates=(500mbit 1gbit 2500mbit 10gbit)
for rate in "${rates[@]}"; do
    bash slurm/testing/virtual_cluster.sh run --nodes 2 --rate "$rate" \
        hpcddp bench train --model mlp --steps 5 --warmup 2 --repeats 5 \
        --variants local,ddp,ddp-hpcddp,horovod,hpcddp,hpcddp-fp16,local-sgd --json "docs/across_nodes/train-$rate.json"
done
bash slurm/testing/virtual_cluster.sh rate none
python docs/render_across_nodes.py docs/across_nodes/train-*.json --out docs/across_nodes.png
