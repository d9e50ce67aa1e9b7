"""hpcddp.horovod.elastic and the elastic driver's parts, in one process (a world of one where a rank is needed)."""

import os
import random
import sys

import pytest
import torch

import hpcddp.horovod as hvd
from hpcddp.cli.elastic import hosts as hosts_module
from hpcddp.cli.elastic.hosts import Host, HostPool, parse_host_lines, parse_hosts, read_hostfile, slurm_hosts
from hpcddp.elastic.commits import CommitStore
from hpcddp.elastic.protocol import HostUpdate, LineReader
from hpcddp.env.elastic import read_elastic_session
from hpcddp.horovod.elastic import sampler as sampler_module


@pytest.fixture
def hvd_world(world_of_one):
    hvd.init()
    yield
    hvd.shutdown()


# ---- hosts -------------------------------------------------------------------------------


@pytest.mark.unit
def test_host_lists_parse_as_mpirun_and_horovod_write_them(tmp_path):
    assert parse_hosts("node1:2,node2") == [Host("node1", 2), Host("node2", 1)]
    assert parse_host_lines("a:4\n\n# down for repair\nb:2  # rack 3\n") == [Host("a", 4), Host("b", 2)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("vnode1 slots=2\n# comment\nvnode2 slots=3 max_slots=4\nvnode3\n")
    assert read_hostfile(str(hostfile)) == [Host("vnode1", 2), Host("vnode2", 3), Host("vnode3", 1)]
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm_hosts(env) == [Host("n1", 2), Host("n2", 2), Host("n3", 1)]


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, message",
    [("a", r"'a' names no slots: write host:slots, e.g. a:2"), ("a:0", r"'a:0' is not host:slots with slots >= 1")],
)
def test_a_discovery_line_without_slots_is_refused_naming_the_script(text, message):
    with pytest.raises(ValueError, match=r"^the host discovery script: " + message):
        parse_host_lines(text)


@pytest.mark.unit
def test_a_failed_host_comes_back_only_after_discovery_dropped_and_listed_it_again(tmp_path):
    listing = tmp_path / "hosts.txt"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    pool = HostPool(discovery_script=str(script))
    listing.write_text("a:2\nb:2\n")
    assert pool.discover() == [Host("a", 2), Host("b", 2)]
    pool.fail(["b"])
    assert pool.discover() == [Host("a", 2)]  # still listed: it failed, it stays out
    listing.write_text("a:2\n")
    assert pool.discover() == [Host("a", 2)]
    listing.write_text("a:2\nb:2\n")
    assert pool.discover() == [Host("a", 2), Host("b", 2)]  # it went away and returned


@pytest.mark.unit
def test_a_failed_host_is_checked_again_after_a_cooldown_that_doubles(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(hosts_module.time, "monotonic", lambda: now[0])
    pool = HostPool(hosts=[Host("a", 2), Host("b", 2)])
    pool.fail(["a"])
    assert pool.discover() == [Host("b", 2)] and pool.due_for_recheck() == []
    now[0] += 10
    assert pool.due_for_recheck() == ["a"]
    pool.rechecked([], ["a"])  # still broken: next check 20 s later
    now[0] += 19
    assert pool.due_for_recheck() == []
    now[0] += 1
    pool.rechecked(["a"], [])
    assert pool.discover() == [Host("a", 2), Host("b", 2)]
    pool.fail(["a"])  # a second failure: 20 s before the first check
    now[0] += 10
    assert pool.due_for_recheck() == []


@pytest.mark.unit
def test_a_failing_discovery_script_is_named(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"--host-discovery-script .*discover.sh exited 3: broken"):
        HostPool(discovery_script=str(script)).discover()


# ---- the rank's session variables, messages, commits ------------------------------------------


@pytest.mark.unit
def test_the_session_variables_are_read_or_refused_in_one_line():
    assert read_elastic_session({}) is None
    env = {"HPCDDP_ELASTIC_DRIVER": "10.0.0.1,127.0.0.1:4567", "HPCDDP_ELASTIC_LAUNCH": "2", "HPCDDP_ELASTIC_RUN": "r"}
    session = read_elastic_session(env)
    assert (session.addresses, session.port, session.launch, session.run) == (("10.0.0.1", "127.0.0.1"), 4567, 2, "r")
    with pytest.raises(ValueError, match=r"^environment variable HPCDDP_ELASTIC_DRIVER must look like"):
        read_elastic_session({"HPCDDP_ELASTIC_DRIVER": "10.0.0.1"})


@pytest.mark.unit
def test_messages_split_across_reads_arrive_whole():
    reader = LineReader()
    assert reader.feed(b'{"beat": 1}\n{"com') == [{"beat": 1}]
    assert reader.feed(b'mit": 3}\nnot json\n') == [{"commit": 3}]


@pytest.mark.unit
def test_a_node_keeps_only_its_newest_whole_commit(tmp_path):
    store = CommitStore("run/1", root=str(tmp_path), host="vnode1")
    other = CommitStore("run/1", root=str(tmp_path), host="vnode2")
    assert store.latest_serial() == -1
    store.write(0, {"w": torch.arange(3.0)})
    store.write(1, {"w": torch.arange(3.0) + 1})
    (tmp_path / f"hpcddp-elastic-{os.getuid()}" / "run_1" / "vnode1" / ".commit-half").write_bytes(
        b"torn"
    )  # a write cut short
    serial, snapshot = store.read()
    assert serial == 1 and torch.equal(snapshot["w"], torch.tensor([1.0, 2.0, 3.0]))
    assert sorted(os.listdir(store.directory)) == [".commit-half", "commit-000000000001.pt"]
    assert other.latest_serial() == -1  # another node's memory, even on a shared file system
    store.remove()
    assert store.latest_serial() == -1


@pytest.mark.unit
def test_an_elastic_job_on_this_host_alone_is_started_as_a_plain_run_oversubscribed_past_the_cores():
    from hpcddp.cli.elastic.launchers import JobLauncher

    many = len(os.sched_getaffinity(0)) + 1
    command, _ = JobLauncher("mpirun", [], dict(os.environ), single_host=True).command(
        [Host("localhost", many)], ["python", "train.py"], {"HPCDDP_ELASTIC_LAUNCH": "0"}
    )
    assert "--oversubscribe" in command and "-H" not in command
    assert command[command.index("-np") + 1] == str(many)
    command, _ = JobLauncher("mpirun", [], dict(os.environ)).command(
        [Host("node1", 2), Host("node2", 2)], ["python", "train.py"], {}
    )
    assert command[command.index("-H") + 1] == "node1:2,node2:2"


# ---- ElasticSampler ----------------------------------------------------------------------------


def _shards(dataset, num_ranks, state=None, epoch=0):
    shards = []
    for rank in range(num_ranks):
        sampler_module.size, sampler_module.rank = (lambda: num_ranks), (lambda r=rank: r)
        sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        if state is not None:
            sampler.load_state_dict(state)
        shards.append(list(sampler))
    return shards


@pytest.mark.unit
def test_the_sampler_shards_a_seeded_permutation_and_reshards_what_is_left(monkeypatch):
    monkeypatch.setattr(sampler_module, "size", sampler_module.size)
    monkeypatch.setattr(sampler_module, "rank", sampler_module.rank)
    dataset = list(range(22))
    order = list(range(22))
    random.Random(5 + 1).shuffle(order)  # Horovod: random.Random(seed + epoch)
    shards = _shards(dataset, 4, epoch=1)
    assert [len(s) for s in shards] == [6, 6, 6, 6]
    padded = order + order[:2]
    assert shards == [padded[r::4] for r in range(4)]
    # 2 batches of 2 per rank were processed at 4 ranks: 16 samples; 3 ranks share the other 6.
    left = _shards(dataset, 3, state={"epoch": 1, "processed_num": 16}, epoch=1)
    assert sorted(sum(left, [])) == sorted(order[16:])
    assert left == [order[16:][r::3] for r in range(3)]


@pytest.mark.unit
def test_the_sampler_counts_batches_over_every_rank_and_set_epoch_starts_over(monkeypatch):
    monkeypatch.setattr(sampler_module, "size", lambda: 2)
    monkeypatch.setattr(sampler_module, "rank", lambda: 1)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    sampler.record_batch(0, 2)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == [5, 7, 9] and len(sampler) == 3
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 0}
    assert list(sampler) == [1, 3, 5, 7, 9]


@pytest.mark.unit
def test_every_rank_gets_a_full_shard_when_fewer_samples_than_ranks_are_left(monkeypatch):
    # 10 samples, 3 ranks, batches of 3: 9 processed before a commit; the start that resumes
    # from it has 1 sample for 3 ranks. A rank with an empty shard would skip the step the
    # others make (a collective mismatch on every start: the job could never finish).
    monkeypatch.setattr(sampler_module, "size", sampler_module.size)
    monkeypatch.setattr(sampler_module, "rank", sampler_module.rank)
    dataset = list(range(10))
    order = list(range(10))
    random.Random(5).shuffle(order)
    shards = _shards(dataset, 3, state={"epoch": 0, "processed_num": 9})
    assert shards == [[order[9]]] * 3
    shards = _shards(dataset, 5, state={"epoch": 0, "processed_num": 8})
    assert [len(s) for s in shards] == [1] * 5 and set(sum(shards, [])) == set(order[8:])


# ---- states ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_object_state_restores_the_last_commit_and_keeps_attributes(hvd_world):
    state = hvd.elastic.ObjectState(epoch=0, best=None)
    state.epoch, state.best = 3, 0.5
    state.commit()
    state.epoch = 7
    state.restore()
    assert (state.epoch, state.best) == (3, 0.5)
    state.sync()  # rank 0's values, here our own
    assert state.epoch == 3


@pytest.mark.unit
def test_torch_state_restores_model_optimizer_and_sampler_to_the_commit(hvd_world):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, batch=0)

    def step():
        optimizer.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()

    step()
    state.batch = 1
    sampler.record_batch(0, 2)
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    committed_exp_avg = optimizer.state[model.weight]["exp_avg"].clone()
    step()
    state.batch = 2
    sampler.record_batch(1, 2)
    state.restore()
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), committed))
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], committed_exp_avg)
    assert state.batch == 1 and sampler.state_dict()["processed_num"] == 2
    # A tracked attribute given a new object tracks (and saves) the new one, as in Horovod.
    new_model = torch.nn.Linear(3, 1)
    state.model = new_model
    with torch.no_grad():
        new_model.weight.zero_()
    state.restore()
    assert not torch.equal(new_model.weight, torch.zeros_like(new_model.weight))


@pytest.mark.unit
@pytest.mark.parametrize(
    "updates, skip_sync", [([HostUpdate.removed], True), ([HostUpdate.added], False), ([1, 2], False)]
)
def test_commit_raises_hosts_updated_once_per_new_update(hvd_world, updates, skip_sync):
    state = hvd.elastic.ObjectState(epoch=0)
    for i, update in enumerate(updates):
        state.on_hosts_updated(10.0 + i, HostUpdate(update))
    with pytest.raises(hvd.HostsUpdatedInterrupt) as interrupt:
        state.commit()
    assert interrupt.value.skip_sync is skip_sync
    state.commit()  # nothing new
    state.on_hosts_updated(5.0, HostUpdate.added)  # older than the last one seen
    state.commit()


@pytest.mark.unit
def test_run_restores_the_commit_and_runs_the_reset_callbacks_after_an_internal_error(hvd_world):
    state = hvd.elastic.ObjectState(step=0)
    calls, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, until):
        calls.append(state.step)
        while state.step < until:
            state.step += 1
            if state.step == 2:
                state.commit()
            if state.step == 3 and len(calls) == 1:
                raise hvd.HorovodInternalError("a collective failed")
        return state.step

    assert train(state, 5) == 5
    assert calls == [0, 2] and resets == [1]


@pytest.mark.unit
def test_a_host_update_sent_while_a_start_began_reaches_its_ranks(hvd_world, monkeypatch):
    import importlib
    import socket

    from hpcddp.cli.elastic.monitor import DriverServer
    from hpcddp.horovod.elastic import state as state_module

    run_module = importlib.import_module("hpcddp.horovod.elastic.run")  # the package's `run` is the function

    # The driver's side: the change came before the rank connected (it was importing torch).
    server = DriverServer("secret", loopback_only=True)
    try:
        server.begin_launch(1, 1)
        server.notify(123.0, HostUpdate.added)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as rank:
            rank.sendall(b'{"hello":"secret","rank":0,"size":1,"host":"h","launch":1}\n')
            reader, messages = LineReader(), []
            while len(messages) < 2:
                messages += reader.feed(rank.recv(1000))
            assert messages == [{"accepted": 1}, {"hosts_updated": 123.0, "update": 2}]
    finally:
        server.close()

    # The rank's side: the link replays it to the state after the reset of a start that resumes a commit.
    class Link:
        def add_listener(self, listener):
            listener(123.0, HostUpdate.added)

        def remove_listener(self, listener):
            pass

    class Session:
        link = Link()
        left = []

        def newest_commit(self, allgather, broadcast):
            return 4, {"objects": {"step": 7}}

        def keep(self, serial, snapshot):
            pass

        def leave_for_restart(self, reason):
            self.left.append(reason)
            raise SystemExit(0)  # as the real one: a clean end, the driver told "restart" first

    session = Session()
    monkeypatch.setattr(run_module, "worker_session", lambda: session)
    monkeypatch.setattr(state_module, "worker_session", lambda: session)
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        state.step += 1
        state.commit()
        return state.step

    with pytest.raises(SystemExit):
        train(state)
    assert session.left == ["the hosts changed"] and state.step == 8


@pytest.mark.unit
def test_a_rank_lost_after_another_finished_ends_the_job_without_a_start_from_scratch():
    from hpcddp.cli.elastic.driver import ElasticConfig, ElasticDriver
    from hpcddp.cli.elastic.launchers import JobLauncher
    from hpcddp.cli.elastic.monitor import RankRecord

    class Server:
        def records(self):
            return {0: RankRecord(0, "h", 0.0, ended="done", commit=6), 1: RankRecord(1, "h", 0.0, ended="lost")}

    driver = ElasticDriver(
        ElasticConfig(min_np=1), HostPool(hosts=[Host("localhost", 2)]), JobLauncher("mpirun", [], {}), ["x"]
    )
    outcome = driver._after_exit(Server(), 137, {"localhost"})
    assert (outcome.kind, outcome.code) == ("finished", 137)


@pytest.mark.unit
@pytest.mark.parametrize(
    "garbage",
    [b"[" * 3000 + b"\n", b"x" * 200_000, b'{"hello":"secret","launch":0}\n', b"\xff\xfe\n"],
    ids=["deeply nested json", "an endless line", "a hello without a rank", "not utf-8"],
)
def test_a_stranger_on_the_driver_port_leaves_the_driver_watching_its_ranks(garbage):
    import socket
    import time

    from hpcddp.cli.elastic.monitor import DriverServer

    server = DriverServer("secret", loopback_only=True)
    try:
        server.begin_launch(0, 1)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stranger:
            stranger.sendall(garbage)
            time.sleep(0.5)
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as rank:
                rank.sendall(b'{"hello":"secret","rank":0,"size":1,"host":"h","launch":0}\n')
                deadline = time.monotonic() + 10
                while not server.records() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert list(server.records()) == [0]
    finally:
        server.close()


@pytest.mark.unit
def test_a_discovery_script_that_fails_or_prints_garbage_leaves_a_running_job_as_it_is(tmp_path):
    from hpcddp.cli.elastic.launchers import JobLauncher
    from hpcddp.cli.elastic.watch import HostWatch

    listing = tmp_path / "hosts.txt"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    watch = HostWatch(HostPool(discovery_script=str(script)), {"localhost"}, None, JobLauncher("mpirun", [], {}))

    def look():  # one look in the watch's thread, then its report
        watch._next = 0.0
        assert watch.poll() == HostUpdate.no_update  # never blocks: the look runs in its thread
        watch._look.join(timeout=30)
        return watch.poll()

    for text in ("this is not host:slots\n", "localhost:x\n"):
        listing.write_text(text)
        assert look() == HostUpdate.no_update
    listing.write_text("localhost:1\nnode2:1\n")
    assert look() == HostUpdate.added


@pytest.mark.ranks
def test_a_discovery_script_unusable_from_the_start_ends_the_job_in_one_line(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho this is not host:slots\n")
    script.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "hpcddp.cli", "run", "-np", "1", "--min-np", "1"]
        + ["--host-discovery-script", str(script), "true"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "is not host:slots with slots >= 1" in result.stderr, result.stderr


@pytest.mark.unit
def test_a_restarted_process_resumes_from_the_nodes_commit_once_not_at_each_elastic_function(tmp_path):
    from hpcddp.elastic.session import WorkerSession

    store = CommitStore("run", str(tmp_path), "h")
    store.write(3, {"objects": {"step": 7}})
    session = object.__new__(WorkerSession)  # its link to a driver plays no part here
    session.launch, session.rank, session.local_rank, session.store, session._resumed = 1, 0, 0, store, False
    gather, bcast = (lambda obj: [obj]), (lambda obj, root: obj)
    assert session.newest_commit(gather, bcast) == (3, {"objects": {"step": 7}})
    # train(state) returned at step 9 (2 steps after the last commit); a second elastic function
    # must not take the state back to the commit.
    assert session.newest_commit(gather, bcast) is None


@pytest.mark.unit
def test_commits_live_in_a_directory_of_this_user_alone(tmp_path):
    store = CommitStore("run", root=str(tmp_path), host="h")
    store.write(0, {"w": 1})
    assert os.stat(store.user_dir).st_mode & 0o777 == 0o700
    os.chmod(store.user_dir, 0o777)  # as another user's directory could be: others may plant a pickle
    with pytest.raises(PermissionError, match="belongs to another user or others may write in it"):
        store.read()


@pytest.mark.unit
@pytest.mark.parametrize(
    "where, code, reported",
    [
        ("train", 3, ["error: sys.exit(3) in hvd.elastic.run"]),
        ("train", "bad config", ["error: sys.exit('bad config') in hvd.elastic.run"]),
        ("reset callback", 3, ["error: sys.exit(3) in hvd.elastic.run"]),
        ("train", 0, []),
        ("train", None, []),
        ("train", False, []),
    ],
)
def test_sys_exit_with_a_failure_code_in_an_elastic_run_is_reported_as_an_error(
    hvd_world, monkeypatch, where, code, reported
):
    import importlib

    from hpcddp.horovod.elastic import state as state_module

    run_module = importlib.import_module("hpcddp.horovod.elastic.run")

    class Session:
        finished = []

        class link:  # noqa: N801 - the session's attribute
            add_listener = remove_listener = staticmethod(lambda listener: None)

        def newest_commit(self, allgather, broadcast):
            # A new start resumes a commit, and runs the reset callbacks before the training function.
            return (4, {"objects": {"step": 7}}) if where == "reset callback" else None

        def finish(self, kind, text=""):
            self.finished.append(f"{kind}: {text}")

    session = Session()
    monkeypatch.setattr(run_module, "worker_session", lambda: session)
    monkeypatch.setattr(state_module, "worker_session", lambda: session)
    state = hvd.elastic.ObjectState(step=0)
    if where == "reset callback":
        state.register_reset_callbacks([lambda: sys.exit(code)])

    @hvd.elastic.run
    def train(state):
        sys.exit(code)

    with pytest.raises(SystemExit):
        train(state)
    # Not "done" (what the exit handler says at a normal end): the driver ends the job as failed.
    assert session.finished == reported


@pytest.mark.unit
def test_the_driver_quotes_a_failed_ranks_error_on_one_line_of_bounded_length(capsys):
    from hpcddp.cli.elastic.driver import ElasticConfig, ElasticDriver
    from hpcddp.cli.elastic.launchers import JobLauncher
    from hpcddp.cli.elastic.monitor import RankRecord

    # Rank 1's message spans lines; rank 2's is the same on one line.
    texts = {
        0: "E" * 5000,
        1: "ValueError: line one\nline two\n\tline three",
        2: "ValueError: line one line two line three",
    }

    class Server:
        def records(self):
            return {r: RankRecord(r, "h", 0.0, ended="error", text=t) for r, t in texts.items()}

    driver = ElasticDriver(
        ElasticConfig(min_np=1), HostPool(hosts=[Host("localhost", 3)]), JobLauncher("mpirun", [], {}), ["x"]
    )
    outcome = driver._after_exit(Server(), 3, {"localhost"})
    assert (outcome.kind, outcome.code) == ("error", 3)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "failed" in line]
    assert f"rank(s) 0 on h, 1 on h, 2 on h failed ({'E' * 300}...; and 1 other message(s)): the job ends" in line
    assert len(line) < 500


# ---- at scale: hundreds of hosts, thousands of ranks ----------------------------------------


@pytest.mark.unit
def test_health_checks_of_512_hosts_sharing_the_drivers_cores_fail_only_the_bad_hosts(monkeypatch):
    from hpcddp.cli.elastic import launchers
    from hpcddp.testing.fake_hosts import FakeHosts

    names = [f"node{i:03d}" for i in range(512)]
    bad, hung = {"node001", "node300"}, {"node007"}
    # Each check needs 0.05 s of the driver's 8 cores: 512 at once take 3.2 s each, past the 1.5 s timeout.
    fakes = FakeHosts(work_s=0.05, capacity=8, bad=bad, hung=hung)
    monkeypatch.setattr(launchers, "stop_launcher", FakeHosts.stop)
    monkeypatch.setattr(launchers.JobLauncher, "_start_check", lambda self, host: fakes.start(host))

    failed = launchers.JobLauncher("mpirun", [], {}).failed_hosts(names, timeout=1.5)

    assert failed == bad | hung
    assert fakes.most_at_once <= 64  # bounded: never every host at once
    assert fakes.started == 512 + len(hung)  # a timeout is checked once more before it fails the host


@pytest.mark.unit
def test_the_driver_holds_more_rank_connections_than_the_soft_open_file_limit():
    import socket
    import subprocess
    import time

    # The driver in a process of its own with a soft limit of 256 (the hard one left as it is).
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import resource, sys\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "from hpcddp.cli.elastic.monitor import DriverServer\n"
            "server = DriverServer('secret', loopback_only=True)\n"
            "server.begin_launch(0, 300)\n"
            "print(server.port, flush=True)\n"
            "sys.stdin.readline()\n"
            "print(len(server.records()), flush=True)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ranks = []
    try:
        port = server.stdout.readline()
        for rank in range(300):
            sock = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
            sock.sendall(f'{{"hello":"secret","rank":{rank},"size":300,"host":"h","launch":0}}\n'.encode())
            ranks.append(sock)
        time.sleep(2)  # the driver's thread reads them
        server.stdin.write("\n")
        server.stdin.flush()
        assert int(server.stdout.readline()) == 300
    finally:
        for sock in ranks:
            sock.close()
        server.kill()
        server.wait(timeout=30)


@pytest.mark.unit
def test_the_driver_says_in_one_line_when_the_ranks_cannot_fit_under_its_hard_file_limit():
    from hpcddp.cli.elastic.monitor import DriverServer

    server = DriverServer("secret", loopback_only=True)
    try:
        server.file_limit, server.file_hard_limit = 1024, 1024
        assert server.room_for(512) is None
        line = server.room_for(4096)
        assert "4096 ranks need 4224 open files in the driver, but its limit is 1024 (hard limit 1024)" in line
        assert "ulimit -Hn 4224" in line and "\n" not in line
    finally:
        server.close()


def wait_for(condition, seconds=10):
    """Return ``condition()`` once it holds, or after ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.unit
def test_beats_keep_a_rank_seen_and_a_connection_closed_without_a_last_word_is_a_lost_rank():
    import socket
    import time

    from hpcddp.cli.elastic.monitor import DriverServer

    server = DriverServer("secret", loopback_only=True)
    try:
        server.begin_launch(0, 1)
        rank = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        rank.sendall(b'{"hello":"secret","rank":0,"size":1,"host":"h","launch":0}\n')
        assert wait_for(lambda: 0 in server.records())
        greeted = server.records()[0].last_seen
        time.sleep(0.3)
        rank.sendall(b'{"beat":1}\n')
        assert wait_for(lambda: server.records()[0].last_seen > greeted)
        rank.close()  # the process died: no "done", "restart" or "error" first
        assert wait_for(lambda: server.records()[0].ended == "lost")
    finally:
        server.close()


# ---- the token and the driver's socket: no other process joins the job -----------------------


@pytest.mark.unit
@pytest.mark.parametrize("where", ["this host alone", "two hosts", "srun"])
def test_the_token_reaches_the_launcher_in_its_environment_never_on_its_command_line(tmp_path, monkeypatch, where):
    from hpcddp.cli.elastic.launchers import JobLauncher

    token = "5ec7e7" * 5
    variables = {"HPCDDP_ELASTIC_TOKEN": token, "HPCDDP_ELASTIC_LAUNCH": "0"}
    if where == "srun":
        srun = tmp_path / "srun"
        srun.write_text("#!/bin/sh\nexit 0\n")
        srun.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    launcher = JobLauncher(
        "srun" if where == "srun" else "mpirun", ["A=1"], dict(os.environ), where == "this host alone"
    )
    hosts = [Host("localhost", 2)] if where == "this host alone" else [Host("node1", 2), Host("node2", 2)]
    command, environ = launcher.command(hosts, ["python", "train.py"], variables)
    assert not [arg for arg in command if token in arg]
    assert environ["HPCDDP_ELASTIC_TOKEN"] == token
    if where != "srun":  # srun's step inherits its environment; mpirun forwards the variable by name
        pairs = list(zip(command, command[1:]))
        assert ("-x", "HPCDDP_ELASTIC_TOKEN") in pairs and ("-x", "HPCDDP_ELASTIC_LAUNCH") in pairs


@pytest.mark.unit
@pytest.mark.parametrize("items, shell", [(["FOO", "FOO=bar"], "s3cret"), (["FOO=bar", "FOO"], None)])
def test_the_elastic_launcher_keeps_the_last_x_for_a_name(items, shell):
    from hpcddp.cli.elastic.launchers import JobLauncher

    environ = {key: value for key, value in os.environ.items() if key != "FOO"}
    if shell is not None:
        environ["FOO"] = shell
    for hosts, single_host in (([Host("localhost", 2)], True), ([Host("node1", 1), Host("node2", 1)], False)):
        command, launch_environ = JobLauncher("mpirun", items, environ, single_host).command(hosts, ["prog"], {})
        assert launch_environ["FOO"] == "bar" and "FOO=bar" in command and "s3cret" not in " ".join(command)


@pytest.mark.unit
def test_this_host_is_known_by_its_names_and_addresses_and_no_other_is():
    import socket

    from hpcddp.cli.elastic.hosts import is_this_host
    from hpcddp.env.network import list_interfaces

    own = socket.gethostname()
    outward = [i.address for i in list_interfaces() if not i.is_loopback]
    names = ["localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", "::1", own, own.upper(), own.split(".")[0]]
    assert all(map(is_this_host, [*names, *outward]))
    others = [f"not-{own}", f"{own}x", f"{own}.other-cluster.invalid", "198.51.100.254", "0.0.0.0", "localhost2"]
    assert not any(map(is_this_host, others))


@pytest.mark.unit
@pytest.mark.parametrize(
    "own, fqdn, name, resolves_to, expected",
    [
        ("vm", "vm", "vm.other-cluster.org", ["203.0.113.9"], False),  # the short name matched before
        ("vm", "vm", "vm.other-cluster.org", None, False),  # does not resolve here: may be another host
        ("vm.cluster.org", "vm.cluster.org", "vm", None, True),  # the short name of its own name
        ("vm.cluster.org", "vm.cluster.org", "vm.other-cluster.org", None, False),
        ("vm", "vm.cluster.org", "VM.cluster.org", None, True),  # its fully qualified name
        ("vm", "vm", "alias", ["127.0.0.1", "::1"], True),  # resolves to loopback alone
        ("vm", "vm", "alias", ["127.0.0.1", "203.0.113.9"], False),  # and to another host too
        ("vm", "vm", "alias", "hangs", False),
    ],
)
def test_a_name_is_this_host_only_when_it_is_its_own_or_resolves_here_alone(
    monkeypatch, own, fqdn, name, resolves_to, expected
):
    import socket
    import threading

    from hpcddp.cli.elastic import hosts

    release = threading.Event()

    def getaddrinfo(host, *args, **kwargs):
        if resolves_to == "hangs":
            release.wait(5)
        if resolves_to in (None, "hangs"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0)) for address in resolves_to]

    monkeypatch.setattr(hosts.socket, "gethostname", lambda: own)
    monkeypatch.setattr(hosts.socket, "getfqdn", lambda: fqdn)
    monkeypatch.setattr(hosts.socket, "getaddrinfo", getaddrinfo)
    try:
        assert hosts.is_this_host(name, timeout=0.2) is expected
    finally:
        release.set()


@pytest.mark.unit
@pytest.mark.parametrize(
    "hosts, bound",
    [
        (["localhost:2"], "127.0.0.1"),
        (["127.0.0.1:1", "this host's name:1"], "127.0.0.1"),
        (["localhost:1", "node1:1"], "0.0.0.0"),
        (["localhost:1", "this host's name.other-cluster.invalid:1"], "0.0.0.0"),
        (None, "0.0.0.0"),  # a discovery script may list any host later
    ],
)
def test_the_driver_listens_on_loopback_alone_when_every_host_of_the_job_is_this_one(tmp_path, hosts, bound):
    import socket

    from hpcddp.cli.elastic.driver import ElasticConfig, ElasticDriver
    from hpcddp.cli.elastic.launchers import JobLauncher

    if hosts is None:
        script = tmp_path / "discover.sh"
        script.write_text("#!/bin/sh\necho localhost:2\n")
        script.chmod(0o755)
        pool = HostPool(discovery_script=str(script))
    else:
        names = ",".join(hosts).replace("this host's name", socket.gethostname())
        pool = HostPool(hosts=parse_hosts(names))
    seen = []

    class Driver(ElasticDriver):
        def _supervise(self, server):  # no launch: what the ranks would be told, and where it listens
            seen.append((server._listener.getsockname()[0], server.addresses))
            return 0

    assert Driver(ElasticConfig(min_np=1), pool, JobLauncher("mpirun", [], {}), ["x"]).run() == 0
    ((address, told),) = seen
    assert address == bound
    assert (told == ["127.0.0.1"]) is (bound == "127.0.0.1")


@pytest.mark.unit
@pytest.mark.parametrize(
    "hello",
    [
        {"hello": "not the token"},
        {},
        {"hello": 12345},
        {"hello": "secret"},  # a second process that knows the token
    ],
    ids=["a wrong token", "no token", "a token that is no string", "the token"],
)
def test_a_hello_for_a_rank_whose_connection_is_live_changes_nothing_and_is_closed(capsys, hello):
    import json
    import socket
    import time

    from hpcddp.cli.elastic.monitor import DriverServer

    server = DriverServer("secret", loopback_only=True)
    try:
        server.begin_launch(0, 2)
        rank = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        rank.sendall(b'{"hello":"secret","rank":1,"size":2,"host":"h","launch":0}\n')
        assert wait_for(lambda: 1 in server.records())
        before = vars(server.records()[1])
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as forger:
            forged = {**hello, "rank": 1, "size": 2, "host": "forger", "launch": 0}
            forger.sendall(json.dumps(forged).encode() + b'\n{"error":"forged"}\n')
            (reply,) = _read_until_closed(forger)  # the driver says why, and closes it
            assert set(reply) == {"refused"}
        time.sleep(0.5)  # the forger's close, had it been taken for rank 1's
        assert vars(server.records()[1]) == before
        rank.sendall(b'{"done":1}\n')  # rank 1's own connection is still the one watched
        assert wait_for(lambda: server.records()[1].ended == "done")
        rank.close()
    finally:
        server.close()
    refused = [line for line in capsys.readouterr().err.splitlines() if "refused" in line]
    if hello.get("hello") == "secret":
        (line,) = refused
        assert "refused a second hello for rank 1 from 127.0.0.1:" in line
        assert "(rank 1 on h is running in start 0): its first connection stays the one watched" in line
    else:
        assert refused == []  # a stranger is closed without a word: port scans make no log


def _read_until_closed(sock):
    """Return the messages ``sock`` receives until the driver closes it."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return LineReader().feed(received)


def _wait_for(condition, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture
def driver_server():
    from hpcddp.cli.elastic.monitor import DriverServer

    server = DriverServer("secret", loopback_only=True)
    server.begin_launch(1, 2)
    yield server
    server.close()


_HELLO = {"hello": "secret", "rank": 0, "size": 2, "host": "h", "launch": 1}


@pytest.mark.unit
@pytest.mark.parametrize(
    "field, value, why",
    [
        ("rank", -1, "rank -1 is not one of the ranks 0..1 of start 1"),
        ("rank", 2, "rank 2 is not one of the ranks 0..1 of start 1"),
        ("rank", 99, "rank 99 is not one of the ranks 0..1 of start 1"),
        ("rank", 10**22, "rank 10000000000000000000000 is not one of"),
        ("rank", "1", "rank '1' is not one of"),
        ("rank", True, "rank True is not one of"),
        ("rank", 1.0, "rank 1.0 is not one of"),
        ("rank", None, "rank None is not one of"),
        ("size", 3, "size 3 is not the 2 ranks of start 1"),
        ("size", 2.0, "size 2.0 is not the 2 ranks of start 1"),
        ("launch", 0, "launch 0 is not the current start, 1"),
        ("launch", True, "launch True is not the current start, 1"),
        ("launch", 1.0, "launch 1.0 is not the current start, 1"),
        ("host", "a\nFAKE LOG LINE", "host 'a\\nFAKE LOG LINE' is not a host name"),
        ("host", 7, "host 7 is not a host name"),
    ],
)
def test_a_hello_with_the_token_for_no_rank_of_this_start_is_refused_in_one_line(
    driver_server, capsys, field, value, why
):
    import json
    import socket

    with socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as forger:
        forger.sendall(json.dumps({**_HELLO, field: value}).encode() + b"\n")
        (reply,) = _read_until_closed(forger)
    assert why in reply["refused"]
    assert driver_server.records() == {}
    (line,) = capsys.readouterr().err.splitlines()
    assert "refused a hello from 127.0.0.1:" in line and why in line


@pytest.mark.unit
def test_a_hello_of_this_start_is_accepted_and_answered(driver_server):
    import json
    import socket

    with socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as rank:
        rank.sendall(json.dumps({**_HELLO, "rank": 1}).encode() + b"\n")
        assert LineReader().feed(rank.recv(1000)) == [{"accepted": 1}]
        assert list(driver_server.records()) == [1]


@pytest.mark.unit
def test_a_lost_forger_for_a_rank_past_the_size_ends_nothing(driver_server):
    import json
    import socket
    import time

    with socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as forger:
        forger.sendall(json.dumps({**_HELLO, "rank": 99}).encode() + b"\n")
    time.sleep(0.3)
    assert driver_server.records() == {}  # the driver's loop would read a record "lost" as a failed rank


def _link(server, rank=0):
    from hpcddp.elastic.worker import DriverLink
    from hpcddp.env.elastic import ElasticSession

    session = ElasticSession(
        addresses=("127.0.0.1",), port=server.port, token="secret", run="r", launch=1, commit_dir=None
    )
    return DriverLink(session, rank, 2, "h")


@pytest.mark.unit
def test_a_rank_whose_hello_is_refused_says_so_in_one_warning(driver_server, caplog):
    import json
    import socket

    with socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as forger:
        forger.sendall(json.dumps({**_HELLO, "host": "forger"}).encode() + b"\n")
        assert _wait_for(lambda: 0 in driver_server.records())
        link = _link(driver_server, rank=0)
        try:
            assert _wait_for(lambda: caplog.records)
        finally:
            link.close()
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelname == "WARNING" and "\n" not in message
    assert f"hpcddp rank 0: the elastic driver at 127.0.0.1:{driver_server.port} refused this rank's hello" in message
    assert "rank 0 has connected already (from forger)" in message and "trains unwatched" in message
    assert not link.accepted and driver_server.records()[0].host == "forger"


@pytest.mark.unit
def test_a_rank_whose_driver_closes_the_connection_at_once_says_so(caplog):
    import socket
    import threading

    from hpcddp.elastic.worker import DriverLink
    from hpcddp.env.elastic import ElasticSession

    with socket.create_server(("127.0.0.1", 0)) as listener:

        def close_at_once():
            conn, _ = listener.accept()
            conn.recv(1000)
            conn.close()

        closer = threading.Thread(target=close_at_once)
        closer.start()
        port = listener.getsockname()[1]
        session = ElasticSession(addresses=("127.0.0.1",), port=port, token="t", run="r", launch=0, commit_dir=None)
        link = DriverLink(session, 3, 4, "h")
        closer.join(10)
        assert _wait_for(lambda: caplog.records)
        link.close()
    (record,) = caplog.records
    assert f"hpcddp rank 3: the elastic driver at 127.0.0.1:{port} closed the connection before it accepted" in (
        record.getMessage()
    )


@pytest.mark.unit
def test_an_accepted_rank_warns_of_nothing_and_its_close_is_its_own(driver_server, caplog):
    link = _link(driver_server, rank=1)
    assert _wait_for(lambda: link.accepted)
    link.finish("done")
    assert _wait_for(lambda: driver_server.records()[1].ended == "done")
    assert caplog.records == []


@pytest.mark.unit
def test_the_session_keeps_the_token_out_of_its_repr():
    env = {"HPCDDP_ELASTIC_DRIVER": "127.0.0.1:4567", "HPCDDP_ELASTIC_TOKEN": "5ec7e7-token"}
    session = read_elastic_session(env)
    assert session.token == "5ec7e7-token" and "5ec7e7" not in repr(session)


# ---- connections that never say hello --------------------------------------------------------


@pytest.mark.unit
def test_a_connection_without_a_hello_is_closed_after_the_deadline(driver_server, monkeypatch):
    import socket
    import time

    from hpcddp.cli.elastic import monitor

    monkeypatch.setattr(monitor, "HELLO_TIMEOUT_S", 0.5)
    with (
        socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as silent,
        socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as partial,
    ):
        partial.sendall(b'{"hello":"sec')  # never ends its line
        started = time.monotonic()
        assert _read_until_closed(silent) == [{"refused": "no hello within 0.5 s"}]
        assert _read_until_closed(partial) == [{"refused": "no hello within 0.5 s"}]
        assert time.monotonic() - started < 3
    assert _wait_for(lambda: not driver_server._connections)


@pytest.mark.unit
@pytest.mark.parametrize("line", [b"1\n", b"[]\n", b'"x"\n', b"not json\n", b"\n"])
def test_a_first_line_that_is_no_json_object_closes_the_connection_at_once(driver_server, line):
    import socket

    with socket.create_connection(("127.0.0.1", driver_server.port), timeout=2) as stranger:
        stranger.sendall(line)
        assert _read_until_closed(stranger) == [{"refused": "the first line is not a JSON object"}]


@pytest.mark.unit
def test_idle_connections_past_the_cap_close_the_oldest_and_ranks_still_get_in(driver_server):
    import json
    import socket

    driver_server.max_waiting = 8
    idle = [socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) for _ in range(40)]
    try:
        assert _wait_for(lambda: len(driver_server._connections) == 8 and len(driver_server._waiting) == 8)
        assert _read_until_closed(idle[0]) == [{"refused": "more than 8 connections wait for a hello"}]
        with socket.create_connection(("127.0.0.1", driver_server.port), timeout=10) as rank:
            rank.sendall(json.dumps(_HELLO).encode() + b"\n")
            assert LineReader().feed(rank.recv(1000)) == [{"accepted": 1}]
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.unit
def test_a_low_open_file_limit_lowers_the_cap_on_waiting_connections(monkeypatch):
    from hpcddp.cli.elastic import monitor

    for limit, cap in ((256, 32), (1024, 128), (20000, 256), (40, 8)):
        monkeypatch.setattr(monitor, "raise_open_file_limit", lambda limit=limit: (limit, limit))
        server = monitor.DriverServer("secret", loopback_only=True)
        server.close()
        assert server.max_waiting == cap


@pytest.mark.unit
def test_a_health_check_that_cannot_start_leaves_the_host_in_the_job(monkeypatch, capsys):
    from hpcddp.cli.elastic import launchers

    def no_files(self, host):
        self._start_error = "Too many open files"
        return None

    monkeypatch.setattr(launchers.JobLauncher, "_start_check", no_files)
    assert launchers.JobLauncher("mpirun", [], {}).failed_hosts(["node1", "node2"], timeout=1) == set()
    (line,) = capsys.readouterr().err.splitlines()
    assert "could not start the health check of node1, node2 twice (Too many open files): counted as working" in line
