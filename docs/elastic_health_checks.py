"""How many healthy hosts the elastic driver's health check blacklists at scale (docs/BENCHMARKS.md).

    python docs/elastic_health_checks.py --hosts 512                        # this tree
    python docs/elastic_health_checks.py --hosts 512 --launchers-from main  # main's checks, same fakes

Simulated hosts (hpcddp.testing.fake_hosts): each check needs --work-s seconds of the driver's
--capacity cores, shared by every check running at once; 4 hosts fail, 2 hang. Prints the
healthy hosts failed, the bad ones found, the wall time and the most checks at once.
"""

import argparse
import importlib.util
import subprocess
import sys
import time

from hpcddp.cli.elastic import launchers
from hpcddp.testing.fake_hosts import FakeHosts

parser = argparse.ArgumentParser()
parser.add_argument("--hosts", type=int, default=512)
parser.add_argument("--work-s", type=float, default=0.5, help="CPU seconds of one check (mpirun's start-up)")
parser.add_argument("--capacity", type=int, default=16, help="checks the driver's host runs at full speed")
parser.add_argument("--timeout", type=float, default=launchers.HEALTH_TIMEOUT_S)
parser.add_argument("--launchers-from", help="a git revision whose hpcddp/cli/elastic/launchers.py to measure")
args = parser.parse_args()

module = launchers
if args.launchers_from:
    source = subprocess.run(
        ["git", "show", f"{args.launchers_from}:hpcddp/cli/elastic/launchers.py"], capture_output=True, check=True
    ).stdout
    path = f"/tmp/launchers_{args.launchers_from.replace('/', '_')}.py"
    with open(path, "wb") as fh:
        fh.write(source)
    # A name inside the package: its relative imports resolve as the original's do.
    spec = importlib.util.spec_from_file_location("hpcddp.cli.elastic._launchers_measured", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

names = [f"node{i:04d}" for i in range(args.hosts)]
bad, hung = set(names[1:5]), set(names[10:12])
fakes = FakeHosts(args.work_s, args.capacity, bad=bad, hung=hung)
module.stop_launcher = FakeHosts.stop


class FakeLauncher(module.JobLauncher):
    def _start_check(self, host):
        return fakes.start(host)


launcher = FakeLauncher("mpirun", (), {})
started = time.monotonic()
failed = launcher.failed_hosts(names, timeout=args.timeout)
wall = time.monotonic() - started
healthy_failed = len(failed - bad - hung)
print(
    f"hosts {args.hosts} healthy_blacklisted {healthy_failed} bad_found {len(failed & (bad | hung))}/{len(bad | hung)} "
    f"wall_s {wall:.1f} most_at_once {fakes.most_at_once} checks {fakes.started}"
)
