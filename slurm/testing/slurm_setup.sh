# shellcheck shell=bash
# Installing Slurm and starting munge, shared by start_cluster.sh and virtual_cluster.sh; sourced,
# not run. The sourcing script defines die() and may set APT_LOG and RESTART.
# shellcheck disable=SC2034  # RESTART is read by the scripts that source this file

PACKAGES=(slurmctld slurmd slurm-client munge libpmix2)
MUNGE_KEY=/etc/munge/munge.key
APT_LOG=${APT_LOG:-$SLURM_TEST_LOG_DIR/apt.log}
RESTART=${RESTART:-0}
# MinJobAge: finished jobs stay visible to squeue/scontrol for at least this long. Below 6 s
# makes `sbatch --wait` poll every 2 s (it backs off to 8 s, or 32 s once MinJobAge > 16).
SLURM_TEST_MIN_JOB_AGE=${SLURM_TEST_MIN_JOB_AGE:-5}
# Step credential lifetime; a requeued job cannot start again before it expires (default 120 s).
SLURM_TEST_CRED_EXPIRE=${SLURM_TEST_CRED_EXPIRE:-10}

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

# Start munged unless it runs, and wait until it answers (one munged serves every test cluster,
# and a site's Slurm on this host too). The pid of one started here goes to $MUNGED_OURS:
# stop_cluster.sh stops only that one.
start_munged() {
    daemon_pid "$MUNGED_PIDFILE" >/dev/null && return 0
    log "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    # munged refuses a key owned by another user, so it runs as munge, like the Debian service.
    env -u TMPDIR setsid runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGED_PIDFILE" </dev/null >/dev/null 2>&1 9>&-
    local i
    for ((i = 0; i < 50; i++)); do
        if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
            daemon_pid "$MUNGED_PIDFILE" >"$MUNGED_OURS" || true
            return 0
        fi
        sleep 0.1
    done
    die "munged is not answering (munge -n | unmunge fails)"
}

# Print the slurm.conf lines both test clusters share: root daemons, munge, no cgroups, a fast
# scheduler and requeue. Uses SLURM_TEST_CRED_EXPIRE and SLURM_TEST_MIN_JOB_AGE.
render_base_conf() {
    cat <<EOF
# Daemons (and their state) run as root: this is a throwaway cluster for tests.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
# cred_expire also delays the restart of a requeued job (default 120 s).
AuthInfo=cred_expire=$SLURM_TEST_CRED_EXPIRE
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
EOF
}
