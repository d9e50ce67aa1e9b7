"""transformers.Trainer (a tiny GPT-2 built in code) on hpcddp's "mpi" backend, or over gloo.

mpirun -np 2 python tests/frameworks/trainer_job.py mpi OUTDIR
torchrun --standalone --nproc_per_node 2 tests/frameworks/trainer_job.py gloo OUTDIR
"""

import torch
from _common import BATCH_SIZE, NUM_EPOCHS, NUM_SAMPLES, end_process_group, parse_arguments, save_result
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class Tokens(torch.utils.data.Dataset):
    """Random sequences of 12 tokens, each its own label (causal language modelling)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.ids = torch.randint(0, 64, (num_samples, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


backend, outdir = parse_arguments()
if backend == "mpi":
    import hpcddp

    hpcddp.init()  # before TrainingArguments picks its devices

set_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir=outdir,
    use_cpu=True,  # without it, on a machine without GPUs every rank trains alone
    ddp_backend=backend,
    per_device_train_batch_size=BATCH_SIZE,
    per_device_eval_batch_size=BATCH_SIZE,
    num_train_epochs=NUM_EPOCHS,
    learning_rate=1e-2,
    seed=0,
    report_to="none",
    save_strategy="no",
    logging_strategy="no",
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(NUM_SAMPLES, 1), eval_dataset=Tokens(10, 2))
trainer.train()
metrics = trainer.evaluate()
save_result(outdir, model, steps=trainer.state.global_step, eval_loss=metrics["eval_loss"])
end_process_group()
