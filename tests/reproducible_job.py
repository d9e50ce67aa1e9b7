"""Train a small net with dropout and AdamW in reproducible mode; rank 0 saves the parameters.

python tests/reproducible_job.py OUT [--backend mpi|gloo] [--stop-after N] [--resume CKPT] [--checkpoint CKPT]

The data, model and schedule are those of ``reproducible_reference`` in tests/test_reproducible.py:
512 samples, 4 per micro-batch, 8 micro-batches per step, 2 epochs (32 steps).
"""

import argparse

import torch

import hpcddp

NUM_SAMPLES, MICRO_BATCH, PER_STEP, EPOCHS, SEED = 512, 4, 8, 2, 7


def make_data():
    generator = torch.Generator().manual_seed(11)
    inputs = torch.randn(NUM_SAMPLES, 10, generator=generator)
    targets = torch.randint(0, 4, (NUM_SAMPLES,), generator=generator)
    return inputs, targets


def make_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--stop-after", type=int, default=None, help="save a checkpoint after this many steps, stop")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--per-step", type=int, default=PER_STEP, help="micro-batches per step, over all ranks")
    args = parser.parse_args()
    hpcddp.init(backend=args.backend, num_threads=1)
    inputs, targets = make_data()
    model = make_model().to(getattr(torch, args.dtype))
    inputs = inputs.to(getattr(torch, args.dtype))
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), model.named_parameters(), reproducible=True
    )
    sampler = hpcddp.MicroBatchSampler(NUM_SAMPLES, MICRO_BATCH, args.per_step, seed=SEED)
    steps = 0
    if args.resume:
        state = hpcddp.load_checkpoint(args.resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        steps = state["steps"]
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for micro_batches in sampler:
            for micro_batch in micro_batches:
                with micro_batch.rng():
                    loss = torch.nn.functional.cross_entropy(
                        model(inputs[micro_batch.indices]), targets[micro_batch.indices]
                    )
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == args.stop_after:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "sampler": sampler.state_dict(),
                    "steps": steps,
                }
                hpcddp.save_checkpoint(args.checkpoint, state)
                return
    if hpcddp.rank() == 0:
        torch.save({"steps": steps, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}, args.out)


if __name__ == "__main__":
    main()
