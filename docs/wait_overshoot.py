"""How late a waiting rank notices that its request completed: the input of the control-cost model.

A non-blocking collective moves on only inside a test on every rank it passes through,
so each hop that arrives while a rank sleeps waits for the rank to wake. This measures
that delay, in one process, for the wait in ``hpcddp.comm.mpi.waits`` and, given the path
of an older ``waits.py`` (``git show 2a65614:hpcddp/comm/waits.py > old_waits.py``), for
that one: a request completes a chosen time after the wait began, and the wait's return
is timed from that moment.

    python docs/wait_overshoot.py [old_waits.py]
"""

import importlib.util
import statistics
import sys
import time

from hpcddp.comm.mpi import waits


class Request:
    """Completes ``after`` seconds after it is made; ``Test`` as mpi4py's."""

    def __init__(self, after: float) -> None:
        self.done_at = time.perf_counter() + after

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return time.perf_counter() >= self.done_at


def overshoot_us(wait, after: float, repeats: int = 200) -> float:
    """Median microseconds between a request's completion and the wait's return."""
    late = []
    for _ in range(repeats):
        request = Request(after)
        wait(request)
        late.append(time.perf_counter() - request.done_at)
    return statistics.median(late) * 1e6


def main() -> None:
    waits_by_name = {"now": waits.wait_for_request}
    if len(sys.argv) > 1:
        spec = importlib.util.spec_from_file_location("old_waits", sys.argv[1])
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        waits_by_name["before"] = old.wait_for_request
    print("completes after (us) | " + " | ".join(f"{name}: overshoot (us)" for name in waits_by_name))
    for after_us in (20, 100, 500, 2000, 10000):
        cells = [f"{overshoot_us(wait, after_us * 1e-6):.1f}" for wait in waits_by_name.values()]
        print(f"{after_us} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
