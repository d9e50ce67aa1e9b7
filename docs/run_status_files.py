"""What ``hpcddp run``'s status directory costs a filesystem at 4,096 ranks: files made, time taken.

Every rank of a job marks its start and its normal exit (``hpcddp.fault.run_status``); here
one process plays all of them, 8 to a node (host names faked), into a directory on the
filesystem of the working directory, then reads the directory as ``hpcddp run`` does at the
end. Run it from a checkout (the code measured is the one ``hpcddp`` imports):

    PYTHONPATH=. python docs/run_status_files.py [ranks]
"""

import os
import socket
import sys
import tempfile
import time
from unittest import mock

from hpcddp.fault import run_status

RANKS = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
RANKS_PER_NODE = 8

with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".run-status-bench-") as directory:
    exits = []
    started = time.perf_counter()
    with mock.patch("atexit.register", lambda *args: exits.append(args)):
        for rank in range(RANKS):
            with mock.patch.object(socket, "gethostname", return_value=f"node{rank // RANKS_PER_NODE}"):
                run_status.mark_started(directory, rank)
    marked = time.perf_counter()
    for rank, (handler, *args) in enumerate(exits):
        if rank != 5:  # one rank killed: it never finishes
            with mock.patch.object(socket, "gethostname", return_value=f"node{rank // RANKS_PER_NODE}"):
                handler(*args)
    finished = time.perf_counter()
    unfinished = run_status.unfinished_ranks(directory)
    read = time.perf_counter()
    print(
        f"{RANKS} ranks: {len(os.listdir(directory))} files; start marks {marked - started:.2f} s, "
        f"finish marks {finished - marked:.2f} s, read {read - finished:.3f} s; unfinished {unfinished}"
    )
