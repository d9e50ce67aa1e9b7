# shellcheck shell=bash
# Paths and helpers shared by start_cluster.sh and stop_cluster.sh; sourced, not run.
# shellcheck disable=SC2034  # the variables are used by the scripts that source this file
# Every path can be overridden from the environment, as long as start and stop see the same values.

# The one-node cluster's own slurm.conf, never Slurm's default /etc/slurm/slurm.conf: a site's
# cluster on this host reads that one. Client commands reach the test cluster with
# SLURM_CONF=$SLURM_TEST_CONF (start_cluster.sh and stop_cluster.sh export it for their own).
SLURM_TEST_CONF=${SLURM_TEST_CONF:-/etc/hpcddp-slurm/slurm.conf}
# slurmctld StateSaveLocation, slurmd SlurmdSpoolDir and the pid files live under here.
SLURM_TEST_STATE_DIR=${SLURM_TEST_STATE_DIR:-/var/spool/hpcddp-slurm}
SLURM_TEST_LOG_DIR=${SLURM_TEST_LOG_DIR:-/var/log/hpcddp-slurm}

SLURMCTLD_PIDFILE=$SLURM_TEST_STATE_DIR/slurmctld.pid
SLURMD_PIDFILE=$SLURM_TEST_STATE_DIR/slurmd.pid
# Debian's munge default, so a munged started by the package's init script is found as well.
MUNGED_PIDFILE=/run/munge/munged.pid
# The pid of the munged these scripts started: only that one is stopped (a munged that a site's
# Slurm on this host runs on is not theirs to stop).
MUNGED_OURS=/run/hpcddp-slurm-munged.pid

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

# Print the pids of the processes listening on TCP port $1 (this network namespace), one a line.
# Read from /proc: no ss or lsof needed.
port_listeners() {
    local hex inode
    printf -v hex ':%04X' "$1"
    # State 0A is LISTEN; column 2 is local address:port in hex, column 10 the socket's inode.
    awk -v port="$hex" '$4 == "0A" && substr($2, length($2) - 4) == port { print $10 }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null | sort -u | while read -r inode; do
        find /proc/[0-9]*/fd -lname "socket:\[$inode\]" 2>/dev/null
    done | cut -d/ -f3 | sort -un
}

# Print "pid N (command line)" for each pid given, comma-separated, for messages.
describe_pids() {
    local pid cmd sep=""
    for pid; do
        # One line, whatever the arguments hold (newlines, a script given with -c), at most 120 characters.
        cmd=$(tr -s '\0\n\t ' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || cmd=""
        cmd=${cmd% }
        ((${#cmd} <= 120)) || cmd="${cmd:0:117}..."
        printf '%spid %s (%s)' "$sep" "$pid" "$cmd"
        sep=", "
    done
    echo
}

# Succeeds when process $1 is process $2 or a child of it (a daemon's helper may share its socket).
is_own_process() {
    local stat ppid
    [[ $1 == "$2" ]] && return 0
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    read -r _ ppid _ <<<"$stat"
    [[ $ppid == "$2" ]]
}

# Print the pids listening on TCP port $1 other than the daemon of pid file $2 and its children.
other_listeners() {
    local own pid
    own=$(daemon_pid "$2") || own=""
    for pid in $(port_listeners "$1"); do
        [[ -n $own ]] && is_own_process "$pid" "$own" && continue
        echo "$pid"
    done
}
