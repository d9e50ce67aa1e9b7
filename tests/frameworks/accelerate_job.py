"""An accelerate training loop on hpcddp's "mpi" backend (docs/porting/frameworks.md), or over gloo.

mpirun -np 2 python tests/frameworks/accelerate_job.py mpi OUTDIR
torchrun --standalone --nproc_per_node 2 tests/frameworks/accelerate_job.py gloo OUTDIR
"""

import torch
from _common import BATCH_SIZE, NUM_EPOCHS, parse_arguments, regression_data, save_result, small_net
from accelerate import Accelerator
from accelerate.utils import set_seed

backend, outdir = parse_arguments()
if backend == "mpi":
    import hpcddp

    hpcddp.init()  # before Accelerator(): it makes torch.distributed.is_mpi_available() true

# cpu=True: without it, on a machine without GPUs accelerate trains every rank alone.
accelerator = Accelerator(cpu=True)
set_seed(0)
model = small_net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train = torch.utils.data.DataLoader(regression_data(), batch_size=BATCH_SIZE, shuffle=True)
# 10 samples over 2 ranks in batches of 4: uneven, padded by accelerate, dropped again by gather_for_metrics.
evaluation = regression_data(10, seed=2)
model, optimizer, train, val = accelerator.prepare(
    model, optimizer, train, torch.utils.data.DataLoader(evaluation, batch_size=BATCH_SIZE)
)

steps = 0
for _ in range(NUM_EPOCHS):
    for inputs, targets in train:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1

model.eval()
with torch.no_grad():
    gathered = torch.cat([accelerator.gather_for_metrics(model(inputs)) for inputs, _ in val])
    # What the gathered predictions must be: the whole evaluation set through this rank's copy.
    local = accelerator.unwrap_model(model)(evaluation.tensors[0])
save_result(
    outdir,
    accelerator.unwrap_model(model),
    steps=steps,
    accelerate_backend=accelerator.state.backend,
    num_processes=accelerator.num_processes,
    gathered=gathered.flatten().tolist(),
    local=local.flatten().tolist(),
)
# accelerate's own last call: it ends the process group (a gloo group still alive at exit can abort).
accelerator.end_training()
