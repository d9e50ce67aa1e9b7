"""A Chrome-trace timeline of training: forward, backward and step, and every bucket's reduction.

    HPCDDP_TIMELINE=timeline.json mpirun -np 2 python train.py   # or hpcddp.init(timeline=...)

Open the file in https://ui.perfetto.dev or chrome://tracing. Each rank is a process;
its "training" track shows ``forward`` (the outermost module call), ``backward`` (from
the gradient of the module's output to the end of the autograd pass), ``synchronize``
(launching the last buckets and waiting for every reduction, still inside
``loss.backward()``) and ``step`` (with ``optimizer.step``); each
bucket has a track with one ``bucket N`` span per reduction holding ``copy-in``
(predivide and compression into the send buffer), ``queue`` (waiting for the
communication thread), ``allreduce`` and ``copy-out``. Buckets reduced while the
backward span is still open are the overlap.

Each rank writes its events as they come, in chunks of ``CHUNK_EVENTS``, to a file of its
own beside the trace (``trace.json.ranks/rank-<r>.jsonl``, under a temporary name until
the end); at ``hpcddp.shutdown()`` (or at exit) rank 0 merges the files into the trace,
reading one line at a time, and removes them. No rank's memory grows with the steps, nor
rank 0's with the ranks. A rank whose node does not see rank 0's file system writes its
file on its own node: rank 0 merges what it can read, says which ranks are missing and
keeps the files; copy the missing ones into ``trace.json.ranks/`` and run
``hpcddp timeline merge trace.json``. A rank that ends the job with an uncaught exception
commits its file as it aborts (``runtime.state.at_abort``); a run's start removes the files,
committed or unfinished, that an earlier run to the same path left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..env.files import PendingFile, make_directory_no_follow, probe_writable
from .merge import merge_rank_files, rank_directory, rank_file, remove_rank_files

__all__ = ["TRAINING_TRACK", "Timeline", "bucket_track", "current", "start", "stop"]

log = logging.getLogger("hpcddp")

TRAINING_TRACK = 0
#: events a rank writes at most (a disk bound: about 130 bytes each)
MAX_EVENTS = 2_000_000
#: events held in memory before they are appended to the rank's file
CHUNK_EVENTS = 4096
#: ranks rank 0 names when their files are missing (the rest are counted)
_NAMED_RANKS = 16


def bucket_track(index: int) -> int:
    """Return the track (Chrome-trace thread id) of bucket ``index``."""
    return index + 1


class Timeline:
    """One rank's recorder; ``hpcddp.init(timeline=path)`` makes it.

    Args:
        path: where rank 0 writes the merged trace.
        rank: this process's rank (the trace's process id).

    Raises:
        OSError: this rank cannot create its event file beside ``path``.
    """

    def __init__(self, path: str | os.PathLike, rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        #: events (one JSON line each) not yet appended to the file
        self.events: list[str] = []
        self.num_written = 0
        make_directory_no_follow(rank_directory(self.path))
        self._file: PendingFile | None = PendingFile(rank_file(self.path, rank), "timeline")
        # Spans come from the training thread, autograd's and the communication thread.
        self._lock = threading.Lock()
        self._track_names = {TRAINING_TRACK: "training"}
        self._origin = time.perf_counter()
        self._forward_depth = 0
        self._forward_start = 0.0
        self._backward_start: float | None = None
        self._dropped = 0
        self._hooks: list[Any] = []

    def align(self) -> None:
        """Start the clock now; called right after a barrier so all ranks share time zero."""
        self._origin = time.perf_counter()

    # -- recording ----------------------------------------------------------------------
    def span(self, name: str, start: float, end: float, track: int = TRAINING_TRACK, **args: Any) -> None:
        """Record a complete span between two ``time.perf_counter()`` readings.

        Args:
            name: what happened.
            start: when it started.
            end: when it ended.
            track: ``TRAINING_TRACK`` or ``bucket_track(i)``.
            args: details shown when the span is selected.
        """
        event = {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": track,
            "ts": round((start - self._origin) * 1e6, 3),
            "dur": round(max(0.0, end - start) * 1e6, 3),
        }
        if args:
            event["args"] = args
        # Encoded here, on the thread that records, so that the thread that fills a chunk
        # (perhaps the communication thread) only joins and writes it.
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            if self._file is None or self.num_written + len(self.events) >= MAX_EVENTS:
                self._dropped += 1
                return
            self.events.append(line)
            if len(self.events) >= CHUNK_EVENTS:
                self._flush()

    def _flush(self) -> None:
        """Append the events held to the file (under ``_lock``)."""
        if not self.events or self._file is None:
            return
        data = "\n".join(self.events) + "\n"
        self.num_written += len(self.events)
        self.events = []
        try:
            self._file.write(data.encode())
        except OSError as err:
            # A full disk must not stop training: the rest of this rank's events are lost, said once.
            log.warning("hpcddp timeline: rank %d stops recording: %s", self.rank, err)
            self._file = None

    @contextlib.contextmanager
    def measure(self, name: str, track: int = TRAINING_TRACK, **args: Any) -> Iterator[None]:
        """Record the time spent in the block as one span."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(name, start, time.perf_counter(), track, **args)

    def name_track(self, track: int, name: str) -> None:
        """Give a track the label Perfetto shows."""
        self._track_names[track] = name

    def bucket_reduction(
        self, index: int, launched: float, submitted: float, handle, copy_out: tuple[float, float], **args: Any
    ) -> None:
        """Record one bucket's reduction: copy-in, queue, allreduce and copy-out inside ``bucket N``.

        Args:
            index: the bucket.
            launched: when the optimizer started preparing the send buffer.
            submitted: when it handed the buffer to the backend.
            handle: the backend's Handle (``started_at``/``completed_at`` when known).
            copy_out: (start, end) of copying the result back into the gradients.
            args: details for the parent span (size, step).
        """
        track = bucket_track(index)
        if track not in self._track_names:
            self._track_names[track] = f"bucket {index} ({args.get('mib', '?')} MiB)"
        started = handle.started_at or submitted
        # On nccl this waits for the bucket's kernels (a host sync per bucket while a timeline is recorded).
        completed = handle.completion_time() or copy_out[0]
        self.span(f"bucket {index}", launched, copy_out[1], track, **args)
        self.span("copy-in", launched, submitted, track)
        if handle.started_at is not None:
            self.span("queue", submitted, started, track)
        self.span("allreduce", started, completed, track)
        self.span("copy-out", copy_out[0], copy_out[1], track)

    # -- forward and backward, from global module hooks ----------------------------------
    def install_module_hooks(self) -> None:
        """Watch every module call; the outermost ones become forward spans."""
        from torch.nn.modules import module

        self._hooks = [
            module.register_module_forward_pre_hook(self._before_forward),
            # always_call: a forward that raises must still close its span, or the
            # depth count would never return to zero.
            module.register_module_forward_hook(self._after_forward, always_call=True),
        ]

    def remove_module_hooks(self) -> None:
        """Stop watching module calls."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _before_forward(self, mod, inputs) -> None:
        if self._forward_depth == 0:
            # A loss module (nn.CrossEntropyLoss) called after the model is not a second forward.
            if next(mod.parameters(), None) is None:
                return
            self._forward_start = time.perf_counter()
        self._forward_depth += 1

    def _after_forward(self, mod, inputs, output) -> None:
        if self._forward_depth == 0:  # the parameterless top-level call skipped above
            return
        self._forward_depth -= 1
        if self._forward_depth:
            return
        self.span("forward", self._forward_start, time.perf_counter(), module=type(mod).__name__)
        tensor = _first_tensor(output)
        if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
            # The gradient of the output is the first thing backward computes for
            # this module: the start of its backward pass.
            tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad):
        if self._backward_start is None:
            self._backward_start = time.perf_counter()
            from torch.autograd import Variable

            Variable._execution_engine.queue_callback(self._on_backward_end)
        return None

    def _on_backward_end(self) -> None:
        if self._backward_start is not None:
            self.span("backward", self._backward_start, time.perf_counter())
            self._backward_start = None

    # -- writing ------------------------------------------------------------------------
    def _metadata(self) -> list[dict[str, Any]]:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        meta.append({"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}})
        for track, label in sorted(self._track_names.items()):
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": track, "args": {"name": label}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": track, "args": {"sort_index": track}}
            )
        return meta

    def close(self) -> str | None:
        """Write the events held and the track names, and give the file its final name.

        Returns why this rank's file could not be written, or None.
        """
        with self._lock:
            if self._file is None:
                return "its disk filled or it could not write its event file"
            self._flush()
            if self._file is None:
                return "its disk filled or it could not write its event file"
            pending, self._file = self._file, None
        try:
            pending.write("".join(json.dumps(event) + "\n" for event in self._metadata()).encode())
            pending.commit()
        except OSError as err:
            return str(err)
        return None

    def discard(self) -> None:
        """Stop recording and remove this rank's unfinished event file."""
        with self._lock:
            pending, self._file, self.events = self._file, None, []
        if pending is not None:
            pending.discard()

    def write(self, comm) -> Path | None:
        """Close every rank's event file, then merge them into the trace on rank 0; collective.

        Args:
            comm: the job's Communicator.
        """
        if self._dropped:
            log.warning(
                "hpcddp timeline: rank %d dropped %d events (past %d, or once its file could not be written)",
                self.rank,
                self._dropped,
                MAX_EVENTS,
            )
        problem = self.close()
        lost: Exception | None = None
        try:
            # One small reply per rank: rank 0 must know every file is complete before it reads them.
            problems = comm.gather_object(problem, 0) if comm.size > 1 else [problem]
        except Exception as err:  # noqa: BLE001 - re-raised below, once rank 0 merged what it has
            # A rank died (its peers' backend says so): rank 0 still merges the files that exist.
            if comm.rank != 0:
                raise
            lost, problems = err, [None] * comm.size
        if comm.rank != 0:
            return None
        try:
            result = merge_rank_files(self.path, comm.size, remove=True)
        except (OSError, ValueError) as err:
            log.warning("hpcddp timeline: %s could not be written: %s", self.path, err)
            result = None
        if lost is not None:
            if result is not None and result.missing:
                log.warning("hpcddp timeline: %s", _describe_missing(self.path, result.missing, {}, comm.size))
            raise lost
        if result is None:
            return None
        failed = {rank: why for rank, why in enumerate(problems) if why is not None}
        if result.missing:
            log.warning("hpcddp timeline: %s", _describe_missing(self.path, result.missing, failed, comm.size))
        log.info("hpcddp timeline written to %s", self.path)
        return self.path


def _describe_missing(path: Path, missing: list[int], failed: dict[int, str], num_ranks: int) -> str:
    """One line naming the ranks whose events are not in the trace, and what to do."""
    named = ", ".join(map(str, missing[:_NAMED_RANKS])) + (
        f" and {len(missing) - _NAMED_RANKS} more" if len(missing) > _NAMED_RANKS else ""
    )
    reasons = {failed[rank] for rank in missing if rank in failed}
    why = f" ({'; '.join(sorted(reasons)[:3])})" if reasons else ""
    return (
        f"{path} lacks the events of rank(s) {named}: rank 0 cannot read their files{why}, perhaps on nodes that do "
        f"not share its file system; the files read are kept in {rank_directory(path)}: copy the missing "
        f"rank-<r>.jsonl there and run `hpcddp timeline merge {path} --ranks {num_ranks}`"
    )


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (list, tuple)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    if isinstance(output, dict):
        return next((t for t in output.values() if isinstance(t, torch.Tensor)), None)
    return None


_recorder: Timeline | None = None


def current() -> Timeline | None:
    """Return this process's Timeline, or None when no timeline is being recorded."""
    return _recorder


def start(path: str | os.PathLike) -> Timeline:
    """Start recording a timeline to ``path`` (``init(timeline=...)`` does this); collective.

    Rank 0 checks at once that it can write ``path``, and every rank that it can write its
    event file beside it, so a bad path fails before training rather than at shutdown.

    Args:
        path: where rank 0 writes the trace when ``stop()`` or ``hpcddp.shutdown()`` runs.
    """
    global _recorder
    from ..runtime import state

    if _recorder is not None:
        raise RuntimeError(f"a timeline is already being recorded to {_recorder.path}: stop() it first")
    comm = state.communicator()
    problem = None
    if comm.rank == 0:
        problem = probe_writable(Path(path).parent)
        if problem is None:
            # Files of an earlier run to the same path, committed or left unfinished by a rank
            # that died: a rank that cannot reach this file system now must show as missing,
            # not with the old run's events. Removed before any rank of this run creates its
            # file (they wait for the broadcast below).
            stale = remove_rank_files(path)
            if stale:
                log.info("hpcddp timeline: removed %d files of an earlier run in %s", stale, rank_directory(path))
    if comm.size > 1:
        problem = comm.broadcast_object(problem, 0)
    if problem is not None:
        raise ValueError(
            f"timeline= (HPCDDP_TIMELINE) {str(path)!r} cannot be written on rank 0: {problem}; choose a writable path"
        )
    recorder, problem = None, None
    try:
        recorder = Timeline(path, comm.rank)
    except OSError as err:
        problem = f"rank {comm.rank}: {type(err).__name__}: {err}"
    if comm.size > 1:
        # Every rank writes a file beside the trace: all start, or all fail with the first reason.
        problems = comm.gather_object(problem, 0)
        problem = comm.broadcast_object(next((p for p in problems or () if p), None), 0)
    if problem is not None:
        if recorder is not None:
            recorder.discard()
        raise ValueError(
            f"timeline= (HPCDDP_TIMELINE) {str(path)!r}: a rank cannot write its events beside it ({problem}); "
            "choose a path every node can write"
        )
    comm.barrier()
    recorder.align()
    recorder.install_module_hooks()
    _recorder = recorder
    # Written at shutdown, or at exit for scripts that never call it.
    state.at_shutdown(stop)
    # A rank that ends the job with an uncaught exception never reaches shutdown: its events
    # up to the failure are what the trace is wanted for.
    state.at_abort(_commit_on_abort)
    return recorder


def _commit_on_abort() -> None:
    """Commit this rank's event file as the job aborts, for a later ``hpcddp timeline merge``."""
    recorder = _recorder
    if recorder is None:
        return
    recorder.remove_module_hooks()
    problem = recorder.close()
    if problem is None:
        log.warning(
            "hpcddp timeline: rank %d ends the job; its events are in %s: once the other ranks' files are there, "
            "run `hpcddp timeline merge %s`",
            recorder.rank,
            rank_file(recorder.path, recorder.rank),
            recorder.path,
        )


def stop() -> Path | None:
    """Stop recording and write the trace on rank 0 (returns its path there); collective."""
    global _recorder
    from ..runtime import state

    recorder, _recorder = _recorder, None
    if recorder is None:
        return None
    recorder.remove_module_hooks()
    return recorder.write(state.communicator())
