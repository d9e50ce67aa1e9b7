# shellcheck shell=bash
# Paths and helpers shared by start_cluster.sh and stop_cluster.sh; sourced, not run.
# shellcheck disable=SC2034  # the variables are used by the scripts that source this file
# Every path can be overridden from the environment, as long as start and stop see the same values.

# slurm.conf location; the Slurm client commands read this path (or $SLURM_CONF) too.
SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
# slurmctld StateSaveLocation, slurmd SlurmdSpoolDir and the pid files live under here.
SLURM_TEST_STATE_DIR=${SLURM_TEST_STATE_DIR:-/var/spool/hpcddp-slurm}
SLURM_TEST_LOG_DIR=${SLURM_TEST_LOG_DIR:-/var/log/hpcddp-slurm}

SLURMCTLD_PIDFILE=$SLURM_TEST_STATE_DIR/slurmctld.pid
SLURMD_PIDFILE=$SLURM_TEST_STATE_DIR/slurmd.pid
# Debian's munge default, so a munged started by the package's init script is found as well.
MUNGED_PIDFILE=/run/munge/munged.pid

# Serialize start/stop calls (e.g. several test workers starting the cluster at once).
lock_cluster() {
    exec 9>/run/lock/hpcddp-slurm-cluster.lock
    flock 9
}

log() {
    printf '[%s] %s\n' "${0##*/}" "$*" >&2
}

# Print the pid recorded in pidfile $1 if that process is alive, else fail.
daemon_pid() {
    local pid stat
    [[ -r $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    # A daemon that died unreaped (a container's pid 1 may reap nothing) is a zombie, which kill -0
    # finds: dead all the same. The state follows the last ')' of /proc/PID/stat.
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]] || return 1
    echo "$pid"
}

# Stop the daemon named $1 whose pid is in pidfile $2: SIGTERM, then SIGKILL after 15 s.
stop_daemon() {
    local name=$1 pidfile=$2 pid i
    pid=$(daemon_pid "$pidfile") || return 0
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    log "$name (pid $pid) ignored SIGTERM for 15 s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}
