"""PyTorch Lightning's DDP on hpcddp's "mpi" backend (docs/porting/frameworks.md), or over gloo.

mpirun -np 2 python tests/frameworks/lightning_job.py mpi OUTDIR
torchrun --standalone --nproc_per_node 2 tests/frameworks/lightning_job.py gloo OUTDIR
"""

import os

import lightning as L
import torch
from _common import BATCH_SIZE, NUM_EPOCHS, end_process_group, parse_arguments, regression_data, save_result, small_net
from lightning.pytorch.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = small_net()

    def training_step(self, batch, _):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def validation_step(self, batch, _):
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


backend, outdir = parse_arguments()
if backend == "mpi":
    import hpcddp

    hpcddp.init()
    # MPIEnvironment: under mpirun inside an sbatch job Lightning would pick its
    # SLURMEnvironment, whose SLURM_PROCID is the batch step's (0 on every rank).
    launch = dict(devices=hpcddp.local_size(), num_nodes=hpcddp.num_nodes(), plugins=[MPIEnvironment()])
else:
    launch = dict(devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=1)

L.seed_everything(0)
model = Regression()
train = torch.utils.data.DataLoader(regression_data(), batch_size=BATCH_SIZE, shuffle=True)
val = torch.utils.data.DataLoader(regression_data(20, seed=2), batch_size=BATCH_SIZE)
trainer = L.Trainer(
    accelerator="cpu",
    strategy=DDPStrategy(process_group_backend=backend),
    max_epochs=NUM_EPOCHS,
    default_root_dir=outdir,  # its checkpoint's path is broadcast from rank 0
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    **launch,
)
trainer.fit(model, train, val)
environment = type(trainer.strategy.cluster_environment).__name__
save_result(
    outdir,
    model,
    steps=trainer.global_step,
    val_loss=trainer.callback_metrics["val_loss"].item(),
    environment=environment,
    lightning_rank=trainer.global_rank,
)
end_process_group()
