"""A writer SIGKILLed in the middle of a checkpoint leaves the previous one readable and loadable."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

import hpcddp.checkpoint as ckpt

from .conftest import ROOT

NUM_ELEMENTS = 8 * 1024 * 1024  # 32 MiB of float32: a write takes long enough to land in
WRITER = textwrap.dedent(
    f"""
    import sys, torch
    from hpcddp.checkpoint import save_checkpoint
    weights = torch.empty({NUM_ELEMENTS})
    for step in range(1, 10_000):
        weights.fill_(step)
        save_checkpoint(sys.argv[1], {{"step": step, "weights": weights}}, keep_last=2)
        print(f"SAVED {{step}}", flush=True)
    """
)


def temporary_files(directory):
    return [name for name in os.listdir(directory) if name.endswith(".tmp")]


def kill_mid_write(directory, deadline_s=120):
    """Start the writer, SIGKILL it while a temporary file is being written; return its output."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and proc.poll() is None:
            # Wait for one complete checkpoint, then for the next save's temporary file.
            if len(ckpt.find_checkpoints(directory)) >= 1 and temporary_files(directory):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the writer was not killed (exit {proc.returncode}):\n{out}"
    return out


def test_killed_writer_leaves_previous_checkpoint_loadable(tmp_path):
    # The kill can race with the rename; retry until it lands inside a write.
    for _attempt in range(5):
        directory = tmp_path / f"attempt{_attempt}"
        directory.mkdir()
        out = kill_mid_write(directory)
        if temporary_files(directory):
            break
    else:
        raise AssertionError("never killed the writer while a checkpoint was being written")
    saved = [int(line.split()[1]) for line in out.splitlines() if line.startswith("SAVED")]
    assert saved, out
    complete = ckpt.find_checkpoints(directory)
    assert 1 <= len(complete) <= 2, complete  # keep_last=2, the torn write is not among them
    state = ckpt.load_checkpoint(directory, map_location="cpu")
    # The newest complete checkpoint is the last one reported saved (or, if the kill
    # hit between its rename and the print, that one), intact to the last element.
    assert state["step"] in (saved[-1], saved[-1] + 1), (state["step"], saved)
    assert state["weights"].shape == (NUM_ELEMENTS,)
    assert bool((state["weights"] == state["step"]).all())
    for path in complete:  # every complete file loads, not only the newest
        older = torch.load(path, map_location="cpu", weights_only=True)
        assert bool((older["weights"] == older["step"]).all())
    # A restarted job saves again next to the torn temporary file.
    ckpt.save_checkpoint(directory, {"step": 99_999, "weights": torch.ones(3)}, keep_last=2)
    assert ckpt.load_checkpoint(directory, map_location="cpu")["step"] == 99_999
