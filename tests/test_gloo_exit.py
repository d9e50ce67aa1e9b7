"""A gloo job's end and a new start: leaving torch.distributed itself, and init() again after shutdown()."""

from hpcddp.testing import run_script

from .conftest import ROOT

SCRIPT = """
    import torch, torch.nn.functional as F, torch.distributed as dist
    import hpcddp

    hpcddp.init(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), bucket_cap_mb=0.05, first_bucket_mb=0.02
    )
    for _ in range(50):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(8, 128)), torch.zeros(8, 128)).backward()
        optimizer.step()
        hpcddp.allreduce(torch.ones(1))
    dist.destroy_process_group()  # the script's own cleanup; hpcddp's exit hook must cope
    print("finished", hpcddp.rank(), len(optimizer.buckets), flush=True)
"""


def test_script_destroying_the_process_group_itself_exits_with_0(tmp_path):
    result = run_script(2, SCRIPT, tmp_path, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "finished 0" in result.stdout and "finished 1" in result.stdout


REINIT = """
    import torch
    import hpcddp.horovod as hvd

    hvd.init()
    kept = hvd.allreduce_async(torch.ones(2), name="never synchronized")  # keeps the old group alive
    hvd.shutdown()
    hvd.init()
    print("summed", hvd.rank(), hvd.allreduce(torch.full((2,), 1.0 + hvd.rank()), op=hvd.Sum).tolist(), flush=True)
    hvd.shutdown()
"""


def test_init_after_shutdown_serves_a_new_rendezvous_while_the_old_group_lives(tmp_path):
    # The second init() served the port the first had chosen, still held by the old group's store:
    # "cannot serve the rendezvous on port ... Address already in use".
    result = run_script(2, REINIT, tmp_path, timeout=180, cwd=ROOT, env={"HPCDDP_BACKEND": "gloo"})
    assert result.returncode == 0, result.stdout[-5000:]
    assert "summed 0 [3.0, 3.0]" in result.stdout and "summed 1 [3.0, 3.0]" in result.stdout
