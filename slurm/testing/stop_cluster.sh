#!/usr/bin/env bash
# Stop the single-host test cluster started by start_cluster.sh: slurmd, slurmctld, then munged.
#
# Daemons are found through their pid files (never by process name); munged is stopped only when
# these scripts started it (a site's Slurm on this host may run on it). Jobs are cancelled first:
# slurmstepd (and the ranks under it) would otherwise outlive slurmd. Pass --purge to also delete
# the controller's state for a clean slate; job ids then start again at 1, so per-job-id files
# (hpcddp-<id>.out, checkpoints/<id>) left from before would be reused by new jobs.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# squeue and scancel below reach this cluster, whatever the caller's SLURM_CONF.
export SLURM_CONF=$SLURM_TEST_CONF

PURGE=0
case ${1:-} in
    --purge) PURGE=1 ;;
    "") ;;
    *)
        echo "usage: stop_cluster.sh [--purge]" >&2
        exit 2
        ;;
esac

if ((EUID != 0)); then
    echo "stop_cluster.sh must run as root, got uid $EUID" >&2
    exit 1
fi

lock_cluster
if daemon_pid "$SLURMCTLD_PIDFILE" >/dev/null; then
    mapfile -t jobs < <(timeout 10 squeue --noheader --format=%A 2>/dev/null || true)
    if ((${#jobs[@]})); then
        log "cancelling jobs ${jobs[*]}"
        scancel "${jobs[@]}" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            [[ -z $(timeout 10 squeue --noheader --format=%A 2>/dev/null || true) ]] && break
            sleep 0.2
        done
    fi
fi
stop_daemon slurmd "$SLURMD_PIDFILE"
stop_daemon slurmctld "$SLURMCTLD_PIDFILE"
munged=$(daemon_pid "$MUNGED_PIDFILE") || munged=""
if [[ -n $munged && $munged == "$(cat "$MUNGED_OURS" 2>/dev/null)" ]]; then
    stop_daemon munged "$MUNGED_PIDFILE"
elif [[ -n $munged ]]; then
    log "leaving munged (pid $munged) running: these scripts did not start it"
fi
rm -f "$MUNGED_OURS"
if ((PURGE)); then
    log "removing $SLURM_TEST_STATE_DIR"
    rm -rf -- "${SLURM_TEST_STATE_DIR:?}"
fi
