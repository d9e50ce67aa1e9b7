"""Print the GPU suite's outcome on one screen, from what run_gpu_suite.sh left in its output folder.

    python tests/gpu/summarize.py OUT_DIR STAGES_FILE
    python tests/gpu/summarize.py --smoke-failures OUT_DIR/smoke.xml

STAGES_FILE has one line per stage, ``name<TAB>status<TAB>seconds<TAB>limit<TAB>note`` (status
"ok", "failed (exit N)", "timed out", "skipped" (asked for, RUN_SUITE=0 or RUN_BENCH=0), "not
run" (something before it failed, or no time was left)). The JUnit files (smoke.xml,
suite.xml), the ranks' outcomes (ranks.json) and the benchmark (bench.json) add the detail.
The same text is written to OUT_DIR/summary.txt. Exits 0 when every stage passed or was
skipped on request; a ranks job whose last launch did not exit 0 fails it too. The
benchmark's figures are checked against issue 50's targets (hpcddp's step <= 1.02x DDP's,
<= 1 host sync per step at world size 1) and each says "target met" or "target missed": a
missed target is a finding reported here, not a failed run (the RESULT line is about the
tests and stages).

``--smoke-failures`` prints which of the smoke test's parts did not pass ("gpu", "mpi",
"nccl"; space-separated, nothing when all did): run_gpu_suite.sh runs what the rest allows.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

#: lines of failure detail per stage, to stay on one screen
MAX_LISTED = 6
#: stage statuses that count as passed ("skipped": RUN_SUITE=0 or RUN_BENCH=0 asked for it)
PASSING = ("ok", "skipped")
#: a ranks test's outcomes listed by name ("not run": collected, but no launch reached it)
NOT_PASSED = ("failed", "did not finish", "not run")
#: lines of a failed benchmark's output shown (its reason, from suite.log)
BENCH_TAIL_LINES = 5
#: the smoke test's parts, by a piece of their test's name (tests/gpu/test_smoke.py)
SMOKE_PARTS = {"gpu": "the_gpu_and_nccl_are_seen", "mpi": "over_mpi", "nccl": "over_nccl"}


def junit_outcomes(path: str) -> dict[str, tuple[str, str]]:
    """``{test name: (passed|failed|skipped, first line of the failure)}`` of a pytest JUnit file.

    A ``<testcase/>`` without a name (pytest interrupted at a stage's limit writes one) is no test.

    Raises:
        ET.ParseError: the file is not XML.
    """
    outcomes: dict[str, tuple[str, str]] = {}
    if not os.path.exists(path):
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        if not name:
            continue
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            outcomes[name] = ("failed", message[0][:150] if message else "")
        elif case.find("skipped") is not None:
            outcomes[name] = ("skipped", "")
        else:
            outcomes[name] = ("passed", "")
    return outcomes


def junit_counts(path: str) -> tuple[dict[str, int], list[str]]:
    """(passed/failed/skipped counts, "name: first line" per failed test) of a pytest JUnit file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        outcomes = junit_outcomes(path)
    except ET.ParseError as err:
        return counts, [f"{os.path.basename(path)} unreadable: {err}"]
    failed = []
    for name, (outcome, message) in outcomes.items():
        counts[outcome] += 1
        if outcome == "failed":
            failed.append(f"{name}: {message}")
    return counts, failed


def smoke_failures(path: str) -> list[str]:
    """The smoke test's parts (``SMOKE_PARTS``) that did not pass in ``path``: failed, skipped or missing."""
    try:
        outcomes = junit_outcomes(path)
    except ET.ParseError:
        outcomes = {}
    passed = [name for name, (outcome, _) in outcomes.items() if outcome == "passed"]
    return [part for part, piece in SMOKE_PARTS.items() if not any(piece in name for name in passed)]


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {what}" for what, n in counts.items() if n) or "no tests"


def summarize(out_dir: str, stages_file: str) -> tuple[list[str], bool]:
    """The summary's lines, and whether every stage that ran passed."""
    lines = [f"== GPU suite summary ({os.environ.get('HPCDDP_GPU_SUITE_DEVICE', 'cuda')})"]
    all_ok = True
    stages = []
    if os.path.exists(stages_file):
        with open(stages_file) as file:
            stages = [line.rstrip("\n").split("\t") for line in file if line.strip()]
    for name, status, seconds, limit, *note in stages:
        all_ok &= status in PASSING
        timing = f"{seconds} s" + (f" of {limit}" if limit else "")
        lines.append(f"{name:<8} {status:<16} {timing:<12} {note[0] if note else ''}".rstrip())
        if name in ("smoke", "suite"):
            counts, failed = junit_counts(os.path.join(out_dir, f"{name}.xml"))
            if status not in ("not run", "skipped"):
                lines.append(f"{'':<8} pytest: {_counts_text(counts)}")
            lines += [f"{'':<8}   FAILED {entry}" for entry in failed[:MAX_LISTED]]
        if name == "suite":
            ranks_lines, ranks_ok = _ranks_lines(os.path.join(out_dir, "ranks.json"))
            lines += ranks_lines
            all_ok &= ranks_ok
        if name == "bench":
            lines += _bench_lines(os.path.join(out_dir, "bench.json"))
            if status not in PASSING and status != "not run":
                lines += [f"{'':<8}   | {line}" for line in _stage_tail(os.path.join(out_dir, "suite.log"), name)]
    ok = all_ok and bool(stages)
    skipped = [f"{name} ({note[0] if note else status})" for name, status, _, _, *note in stages if status == "skipped"]
    verdict = "PASSED" if ok else "FAILED"
    verdict += f"; skipped: {', '.join(skipped)}" if skipped else "; no stage skipped"
    verdict += " (the stages and tests; speed targets are reported above, a miss does not fail the run)"
    files = {f for f in os.listdir(out_dir) if not f.startswith(".")} | {"summary.txt"}  # written after these lines
    lines.append(f"== RESULT: {verdict}")
    lines.append(f"== files in {out_dir}: {' '.join(sorted(files))}")
    return lines, ok


def _stage_tail(log_path: str, name: str) -> list[str]:
    """The last lines a stage printed in suite.log (between run_gpu_suite.sh's "== stage NAME" lines)."""
    if not os.path.exists(log_path):
        return []
    with open(log_path, errors="replace") as file:
        text = file.read()
    begin = text.rfind(f"== stage {name} (limit")
    if begin < 0:
        return []
    body = text[begin:].splitlines()[1:]
    end = next((i for i, line in enumerate(body) if line.startswith(f"== stage {name}:")), len(body))
    return [line[:150] for line in body[:end] if line.strip()][-BENCH_TAIL_LINES:]


def _ranks_lines(path: str) -> tuple[list[str], bool]:
    """The ranks jobs' lines, and False when a job's last launch did not exit 0 (a crash after its tests)."""
    if not os.path.exists(path):
        return [], True
    with open(path) as file:
        jobs = json.load(file)
    lines, ok = [], True
    for job, outcome in jobs.items():
        tally: dict[str, int] = {}
        for result in outcome["tests"].values():
            tally[result] = tally.get(result, 0) + 1
        launches = outcome["launches"]
        lines.append(f"{'':<8} {job}: {_counts_text(tally)}, {outcome['seconds']} s, {len(launches)} launch(es)")
        if len(launches) != 1 or not launches[0].startswith("exit 0"):
            lines.append(f"{'':<8}   launches: {'; '.join(launches)}")
        if not launches or not launches[-1].startswith("exit 0"):
            ok = False
            lines.append(f"{'':<8}   FAILED: the job's last launch did not exit 0")
        bad = [nodeid for nodeid, result in outcome["tests"].items() if result in NOT_PASSED]
        lines += [f"{'':<8}   {outcome['tests'][n].upper()} {n.split('::')[-1]}" for n in bad[:MAX_LISTED]]
    return lines, ok


def _bench_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as file:
        report = json.load(file)
    lines = [f"{'':<8} {report['device']}, torch {report['torch']}, {report['backend']} at world size 1, bf16 autocast"]
    for row in report["results"]:
        ms, syncs = row["median_ms"], row["host_syncs_per_step"]
        targets = row.get("targets", {})
        sync_text = f"host syncs/step hpcddp {max(syncs['hpcddp'])} ddp {max(syncs['ddp'])}" if syncs["plain"] else ""
        lines.append(
            f"{'':<8} {row['model']:<11} plain {ms['plain']:.2f} ddp {ms['ddp']:.2f} hpcddp {ms['hpcddp']:.2f} ms"
            f"  hpcddp/ddp {row['hpcddp_over_ddp']:.3f}  {row.get('hpcddp_buckets', '?')} buckets  {sync_text}".rstrip()
        )
        for figure, what in (("hpcddp_over_ddp", "hpcddp/ddp step"), ("host_syncs_per_step", "host syncs/step")):
            target = targets.get(figure)
            if target is not None:
                met = {True: "target met", False: "target missed", None: "not measured (no CUDA)"}[target["met"]]
                lines.append(f"{'':<8}   {what} {target['target']}: {met}")
    if report["results"]:
        lines.append(f"{'':<8}   (host syncs: torch's sync debug mode; an event.synchronize() is not counted)")
    if report.get("not_yet_run"):
        lines.append(f"{'':<8}   not run: {', '.join(report['not_yet_run'])} (the benchmark ended before them)")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--smoke-failures":
        print(" ".join(smoke_failures(argv[1])))
        return 0
    if len(argv) != 2:
        print("usage: python tests/gpu/summarize.py OUT_DIR STAGES_FILE | --smoke-failures SMOKE_XML", file=sys.stderr)
        return 2
    out_dir, stages_file = argv
    lines, ok = summarize(out_dir, stages_file)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.txt"), "w") as file:
        file.write(text)
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
