#!/usr/bin/env bash
# Training step against link rate on 2 virtual nodes x 2 ranks (slurm/testing/virtual_cluster.sh):
# torch DDP (gloo; over the hpcddp backend, also with torch's PowerSGD hook), hpcddp's default, fp16,
# PowerSGD and int8 gradients, local SGD (parameters averaged every 4 steps), and Horovod when it
# imports (in jobs of its own, docs/horovod_step.py, alternated with hpcddp's: the two libraries in one
# process hang across rate-limited nodes). One JSON per rate and job in docs/across_nodes/, then the
# plot (docs/across_nodes.png) and the table. Needs root (network namespaces); ~25 minutes on 2 cores.
#
#   bash docs/across_nodes.sh [RATE...]        default: 500mbit 1gbit 2500mbit 10gbit
#   PYTHONPATH=<dir holding horovod/> bash docs/across_nodes.sh    # to include Horovod
set -euo pipefail
cd "$(dirname "$0")/.."
rates=("$@")
((${#rates[@]})) || rates=(500mbit 1gbit 2500mbit 10gbit)
has_horovod=0
python -c "import horovod.torch" 2>/dev/null && has_horovod=1
for rate in "${rates[@]}"; do
    bash slurm/testing/virtual_cluster.sh run --nodes 2 --rate "$rate" \
        hpcddp bench train --model mlp --steps 5 --warmup 2 --repeats 3 \
        --variants local,ddp,ddp-hpcddp,ddp-powersgd,hpcddp,hpcddp-fp16,hpcddp-powersgd,hpcddp-int8,local-sgd \
        --json "docs/across_nodes/train-$rate.json"
    if ((has_horovod)); then
        bash slurm/testing/virtual_cluster.sh run --nodes 2 --rate "$rate" \
            python docs/horovod_step.py --steps 5 --warmup 2 --repeats 3 --json "docs/across_nodes/horovod-$rate.json"
    fi
done
bash slurm/testing/virtual_cluster.sh rate none
python docs/render_across_nodes.py docs/across_nodes/*.json --out docs/across_nodes.png --table
