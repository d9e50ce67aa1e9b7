#!/usr/bin/env bash
# A cluster of virtual nodes on this one host, for multi-node tests and benchmarks.
#
#   virtual_cluster.sh up [--nodes N] [--rate RATE] [--slurm]   start it (idempotent)
#   virtual_cluster.sh rate RATE|none        limit every node's outgoing link (tc tbf), or lift it
#   virtual_cluster.sh env                   print the variables that let mpirun/srun reach the nodes
#   virtual_cluster.sh exec NODE COMMAND...  run a command on a node (vnode_exec.sh)
#   virtual_cluster.sh link NODE up|down     connect or cut off a node (a node failure)
#   virtual_cluster.sh crash NODE            kill every process on a node but its slurmd (a crash)
#   virtual_cluster.sh run [--nodes N] [--rate RATE] COMMAND...
#                                            run COMMAND on every slot of the nodes with `hpcddp run`
#                                            (starts the cluster if needed; e.g. `hpcddp bench train`)
#   virtual_cluster.sh status
#   virtual_cluster.sh down                  stop everything and remove every trace
#
# Each node is a network + UTS namespace held by a `sleep`: its own hostname (vnode1, ...), its own
# eth0 with its own IP on a bridge, and the host's file system (a shared file system, as on a
# cluster). The node names are in no DNS and no /etc/hosts, as on clusters whose node names only
# the scheduler knows. Traffic stays on the bridge: no address outside the namespaces made here.
#
# Open MPI reaches the nodes through a hostfile and vnode_exec.sh as its rsh agent; `env` prints
#   PRTE_MCA_plm_ssh_agent, VCLUSTER_HOSTFILE, and with --slurm the SLURM_CONF of a multi-node
# Slurm (slurmctld on the bridge address, one slurmd per node inside its namespaces) that lives
# beside the one-node cluster of start_cluster.sh: own ports, own state, own SLURM_CONF.
#
# Verified on Debian 12 (2 cores), Open MPI 5.0.11 (pip), Slurm 22.05: up from nothing ~2 s
# (+ ~3 s with --slurm), down ~1 s.
set -euo pipefail

# Nodes to create (vnode1 .. vnodeN).
VCLUSTER_NODES=${VCLUSTER_NODES:-2}
# The /24 the bridge (.1) and the nodes (.11, .12, ...) live on; nothing outside it is addressed.
VCLUSTER_SUBNET=${VCLUSTER_SUBNET:-10.213.0}
# Slots per node in the hostfile (ranks mpirun places on a node before the next).
VCLUSTER_SLOTS=${VCLUSTER_SLOTS:-2}
# CPUs each slurmd declares (more than the real cores is fine: config_overrides).
VCLUSTER_CPUS=${VCLUSTER_CPUS:-4}
VCLUSTER_STATE=${VCLUSTER_STATE:-/run/hpcddp-vcluster}
VCLUSTER_BRIDGE=${VCLUSTER_BRIDGE:-hpcvbr0}
# Ports of the multi-node Slurm; the one-node cluster takes 6827/6828, a site's Slurm on this host
# Slurm's defaults (6817/6818).
VCLUSTER_CTLD_PORT=${VCLUSTER_CTLD_PORT:-6917}
VCLUSTER_SLURMD_PORT=${VCLUSTER_SLURMD_PORT:-6918}
SLURM_TEST_LOG_DIR=${SLURM_TEST_LOG_DIR:-/var/log/hpcddp-slurm}
# Seconds to wait for the Slurm nodes to come up before failing.
SLURM_TEST_TIMEOUT=${SLURM_TEST_TIMEOUT:-60}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"
# shellcheck source-path=SCRIPTDIR source=slurm_setup.sh
source "$HERE/slurm_setup.sh"

NODES_FILE=$VCLUSTER_STATE/nodes
SLURM_DIR=$VCLUSTER_STATE/slurm
VC_SLURM_CONF=$SLURM_DIR/slurm.conf
CTLD_PIDFILE=$SLURM_DIR/slurmctld.pid
PREFIX=vnode

die() {
    echo "virtual_cluster.sh: $*" >&2
    local f
    for f in "$SLURM_TEST_LOG_DIR"/vc-slurm*.log; do
        [[ -r $f ]] || continue
        echo "----- last lines of $f -----" >&2
        tail -n 15 "$f" >&2
    done
    exit 1
}

usage() {
    sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

holder_of() { awk -v n="$1" '$1 == n || $2 == n { print $3 }' "$NODES_FILE" 2>/dev/null; }
node_names() { awk '{ print $1 }' "$NODES_FILE" 2>/dev/null; }
in_node() {
    local node=$1
    shift
    nsenter --target "$(holder_of "$node")" --uts --net -- "$@"
}

# Succeeds when every node recorded in the state is alive and the bridge exists.
cluster_alive() {
    [[ -s $NODES_FILE ]] && ip link show "$VCLUSTER_BRIDGE" >/dev/null 2>&1 || return 1
    local name address holder ns
    while read -r name address holder ns; do
        [[ $(readlink "/proc/$holder/ns/net" 2>/dev/null) == "$ns" ]] || return 1
    done <"$NODES_FILE"
}

check_namespaces() {
    ((EUID == 0)) || die "must run as root (network namespaces, bridges), got uid $EUID"
    local tool
    for tool in unshare nsenter ip tc; do
        command -v "$tool" >/dev/null || die "$tool not found (Debian: apt-get install util-linux iproute2)"
    done
    unshare --uts --net true 2>/dev/null || die "cannot create network and UTS namespaces here (unshare --uts --net fails)"
}

start_node() {
    local index=$1 name=$PREFIX$1 address=$VCLUSTER_SUBNET.$((10 + $1)) holder i
    # setsid: the holder must outlive the calling session (a test's process group is killed).
    setsid unshare --uts --net -- sleep infinity </dev/null >/dev/null 2>&1 9>&- &
    holder=$!
    for ((i = 0; i < 50; i++)); do
        [[ $(readlink "/proc/$holder/ns/net" 2>/dev/null) != "$(readlink /proc/self/ns/net)" ]] && break
        sleep 0.05
    done
    ((i < 50)) || die "node $name: the namespace holder (pid $holder) did not start"
    nsenter --target "$holder" --uts -- hostname "$name"
    ip link add "hv-$name" type veth peer name eth0 netns "$holder"
    ip link set "hv-$name" master "$VCLUSTER_BRIDGE" up
    nsenter --target "$holder" --net -- ip addr add "$address/24" dev eth0
    nsenter --target "$holder" --net -- ip link set eth0 up
    nsenter --target "$holder" --net -- ip link set lo up
    # The namespace id too: processes left in it are found even after the holder died.
    echo "$name $address $holder $(readlink "/proc/$holder/ns/net")" >>"$NODES_FILE"
    log "node $name: $address (namespace holder pid $holder), index $index"
}

write_env() {
    local hosts
    hosts=$(node_names | tr '\n' ' ')
    {
        echo "# Written by virtual_cluster.sh: source it, or let the tests read it."
        echo "export VCLUSTER_STATE=$VCLUSTER_STATE"
        echo "export VCLUSTER_HOSTFILE=$VCLUSTER_STATE/hostfile"
        echo "export VCLUSTER_HOSTS='${hosts% }'"
        # Open MPI's daemons start through vnode_exec.sh instead of ssh.
        echo "export PRTE_MCA_plm_ssh_agent=$HERE/vnode_exec.sh"
        # mpirun and its daemons talk over the bridge only.
        echo "export PRTE_MCA_oob_tcp_if_include=$VCLUSTER_SUBNET.0/24"
        # The nodes share this host's cores, which no node can see: waiting ranks must yield.
        echo "export OMPI_MCA_mpi_yield_when_idle=1"
        # One TCP connection per pair of ranks moved 64 MB/s over a 1 Gbit/s tbf-limited veth,
        # two moved 125 MB/s (docs/BENCHMARKS.md, "Across nodes"); gloo opens its own.
        echo "export OMPI_MCA_btl_tcp_links=${OMPI_MCA_btl_tcp_links:-2}"
        if [[ -s $VC_SLURM_CONF ]]; then
            echo "export SLURM_CONF=$VC_SLURM_CONF"
        fi
    } >"$VCLUSTER_STATE/env"
}

cmd_up() {
    local rate="" slurm=0
    while (($#)); do
        case $1 in
            --nodes) VCLUSTER_NODES=$2 && shift 2 ;;
            --rate) rate=$2 && shift 2 ;;
            --slurm) slurm=1 && shift ;;
            *) usage ;;
        esac
    done
    [[ $VCLUSTER_NODES =~ ^[1-9][0-9]?$ ]] || die "--nodes must be 1..99, got '$VCLUSTER_NODES'"
    check_namespaces
    if cluster_alive && (($(wc -l <"$NODES_FILE") == VCLUSTER_NODES)); then
        log "up already: $(node_names | tr '\n' ' ')"
    else
        stop_everything
        install -d -m 0755 "$VCLUSTER_STATE"
        : >"$NODES_FILE"
        ip link add "$VCLUSTER_BRIDGE" type bridge
        ip addr add "$VCLUSTER_SUBNET.1/24" dev "$VCLUSTER_BRIDGE"
        ip link set "$VCLUSTER_BRIDGE" up
        local i
        for ((i = 1; i <= VCLUSTER_NODES; i++)); do
            start_node "$i"
        done
        node_names | sed "s/\$/ slots=$VCLUSTER_SLOTS/" >"$VCLUSTER_STATE/hostfile"
    fi
    [[ -n $rate ]] && cmd_rate "$rate"
    ((slurm)) && start_slurm
    write_env
    log "virtual cluster up: $(node_names | tr '\n' ' ')(source $VCLUSTER_STATE/env)"
}

# tbf needs a bucket of at least rate/HZ bytes; 10 ms of traffic (at least 256 kB) is plenty.
cmd_rate() {
    local rate=$1 node bits burst
    cluster_alive || die "the virtual cluster is not up"
    for node in $(node_names); do
        if [[ $rate == none ]]; then
            in_node "$node" tc qdisc del dev eth0 root 2>/dev/null || true
            continue
        fi
        bits=$(tc_bits "$rate") || die "rate must look like 500mbit, 1gbit or 10gbit, got '$rate'"
        burst=$((bits / 8 / 100))
        ((burst < 262144)) && burst=262144
        in_node "$node" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
    done
    echo "$rate" >"$VCLUSTER_STATE/rate"
    log "link rate of every node: $rate"
}

tc_bits() {
    [[ $1 =~ ^([0-9]+)(k|m|g)?bit$ ]] || return 1
    local scale=1
    case ${BASH_REMATCH[2]} in
        k) scale=1000 ;;
        m) scale=1000000 ;;
        g) scale=1000000000 ;;
    esac
    echo $((BASH_REMATCH[1] * scale))
}

cmd_link() {
    if (($# != 2)) || [[ $2 != up && $2 != down ]]; then
        usage
    fi
    [[ -n $(holder_of "$1") ]] || die "no virtual node '$1'"
    in_node "$1" ip link set eth0 "$2"
    log "node $1: link $2"
}

# The node's processes die at once, as in a crash; its namespace and slurmd stay, as if it
# rebooted at once, so that later jobs find it. (Nodes share this host's process table: a
# process is on a node when it is in the node's network namespace.)
cmd_crash() {
    (($# == 1)) || usage
    local ns dir pid killed=()
    ns=$(awk -v n="$1" '$1 == n { print $4 }' "$NODES_FILE" 2>/dev/null)
    [[ $ns == net:* ]] || die "no virtual node '$1'"
    for dir in /proc/[0-9]*; do
        pid=${dir#/proc/}
        [[ $(readlink "$dir/ns/net" 2>/dev/null) == "$ns" ]] || continue
        [[ $pid == "$(holder_of "$1")" ]] && continue
        [[ $(cat "$dir/comm" 2>/dev/null) == slurmd ]] && continue
        kill -KILL "$pid" 2>/dev/null && killed+=("$pid")
    done
    log "node $1: crashed (killed ${#killed[@]} processes: ${killed[*]})"
}

render_vc_conf() {
    local tmpfs=$1 node
    cat <<EOF
# Multi-node test cluster of virtual nodes, written by slurm/testing/virtual_cluster.sh.
ClusterName=hpcddp-vc
SlurmctldHost=$(hostname -s)($VCLUSTER_SUBNET.1)
SlurmctldPort=$VCLUSTER_CTLD_PORT
SlurmdPort=$VCLUSTER_SLURMD_PORT
StateSaveLocation=$SLURM_DIR/slurmctld
SlurmdSpoolDir=$SLURM_DIR/spool/%n
SlurmctldPidFile=$CTLD_PIDFILE
SlurmdPidFile=$SLURM_DIR/slurmd-%n.pid
SlurmctldLogFile=$SLURM_TEST_LOG_DIR/vc-slurmctld.log
SlurmdLogFile=$SLURM_TEST_LOG_DIR/vc-slurmd-%n.log
# Per node: PMIx puts its client directories here, and they collide in a shared /tmp.
TmpFS=$tmpfs
EOF
    render_base_conf
    for node in $(node_names); do
        echo "NodeName=$node NodeAddr=$(awk -v n="$node" '$1 == n { print $2 }' "$NODES_FILE") CPUs=$VCLUSTER_CPUS RealMemory=4096 State=UNKNOWN"
    done
    echo "PartitionName=vc Nodes=$(node_names | paste -sd, -) Default=YES MaxTime=INFINITE State=UP"
}

start_slurm() {
    install -d "$SLURM_DIR/slurmctld" "$SLURM_TEST_LOG_DIR"
    install_packages
    ensure_pmix_symlink
    ensure_munge_key
    start_munged
    local node conf others
    # A slurmctld that loses its port exits, and the process holding it answers in its place.
    others=$(other_listeners "$VCLUSTER_CTLD_PORT" "$CTLD_PIDFILE")
    # shellcheck disable=SC2086  # one pid a word
    [[ -z $others ]] || die "VCLUSTER_CTLD_PORT=$VCLUSTER_CTLD_PORT is taken by $(describe_pids $others), not by the virtual cluster's slurmctld: stop that process, or set VCLUSTER_CTLD_PORT to a free port"
    # Every slurmd gets a copy that differs only in TmpFS; slurmctld and the clients use the first.
    render_vc_conf /tmp >"$VC_SLURM_CONF"
    if ! daemon_pid "$CTLD_PIDFILE" >/dev/null; then
        log "starting slurmctld on $VCLUSTER_SUBNET.1:$VCLUSTER_CTLD_PORT"
        SLURM_CONF=$VC_SLURM_CONF env -u TMPDIR setsid /usr/sbin/slurmctld -f "$VC_SLURM_CONF" </dev/null \
            >>"$SLURM_TEST_LOG_DIR/vc-slurmctld.stdout" 2>&1 9>&- || die "slurmctld failed to start"
    fi
    for node in $(node_names); do
        conf=$SLURM_DIR/slurm-$node.conf
        install -d "$SLURM_DIR/spool/$node" "/tmp/hpcddp-vcluster/$node"
        render_vc_conf "/tmp/hpcddp-vcluster/$node" >"$conf"
        daemon_pid "$SLURM_DIR/slurmd-$node.pid" >/dev/null && continue
        log "starting slurmd on $node"
        SLURM_CONF=$conf in_node "$node" env -u TMPDIR setsid /usr/sbin/slurmd -f "$conf" -N "$node" </dev/null \
            >>"$SLURM_TEST_LOG_DIR/vc-slurmd-$node.stdout" 2>&1 9>&- || die "slurmd on $node failed to start"
    done
    wait_for_slurm_nodes
}

wait_for_slurm_nodes() {
    local states="" deadline=$((SECONDS + SLURM_TEST_TIMEOUT)) resumed=0
    while ((SECONDS < deadline)); do
        states=$(SLURM_CONF=$VC_SLURM_CONF timeout 10 sinfo --noheader --format=%T 2>/dev/null | sort -u | tr '\n' ' ')
        [[ $states =~ ^(idle|mixed|allocated|completing)\ $ ]] && return 0
        if [[ $states =~ (drain|down) ]] && ((!resumed)); then
            SLURM_CONF=$VC_SLURM_CONF scontrol update NodeName="$(node_names | paste -sd, -)" State=RESUME \
                >/dev/null 2>&1 || true
            resumed=1
        fi
        sleep 0.5
    done
    die "the Slurm nodes did not become idle within ${SLURM_TEST_TIMEOUT}s (sinfo: '${states:-no answer}')"
}

# Kill every process inside the node's network namespace $1 (ranks, daemons, its holder).
stop_node() {
    local ns=$1 dir
    [[ $ns == net:* ]] || return 0
    for dir in /proc/[0-9]*; do
        if [[ $(readlink "$dir/ns/net" 2>/dev/null) == "$ns" ]]; then
            kill -KILL "${dir#/proc/}" 2>/dev/null || true
        fi
    done
}

stop_everything() {
    if [[ -s $VC_SLURM_CONF ]] && daemon_pid "$CTLD_PIDFILE" >/dev/null; then
        SLURM_CONF=$VC_SLURM_CONF timeout 10 scancel --full --quiet "--partition=vc" 2>/dev/null || true
        stop_daemon slurmctld "$CTLD_PIDFILE"
    fi
    local name address holder ns
    if [[ -r $NODES_FILE ]]; then
        while read -r name address holder ns; do
            stop_node "$ns"
        done <"$NODES_FILE"
    fi
    local link
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{ print $2 }' | cut -d@ -f1 | grep -E "^hv-${PREFIX}[0-9]+$"); do
        ip link del "$link" 2>/dev/null || true
    done
    ip link del "$VCLUSTER_BRIDGE" 2>/dev/null || true
    rm -rf -- "${VCLUSTER_STATE:?}" /tmp/hpcddp-vcluster
}

# Benchmarks across the nodes: `run --rate 1gbit hpcddp bench train` is one command anyone can rerun.
cmd_run() {
    local up_args=() rate=""
    while (($#)); do
        case $1 in
            --nodes) up_args+=(--nodes "$2") && shift 2 ;;
            --rate) rate=$2 && shift 2 ;;
            *) break ;;
        esac
    done
    (($#)) || usage
    (
        exec 9>/run/lock/hpcddp-vcluster.lock
        flock 9
        cmd_up "${up_args[@]}"
        cmd_rate "${rate:-none}"
    )
    local ranks
    ranks=$(awk -F'slots=' '{ n += $2 } END { print n }' "$VCLUSTER_STATE/hostfile")
    set -a
    # shellcheck source=/dev/null
    source "$VCLUSTER_STATE/env"
    set +a
    log "running on $ranks ranks of $(node_names | paste -sd' ' -), link rate ${rate:-unlimited}: $*"
    exec hpcddp run -np "$ranks" --hostfile "$VCLUSTER_STATE/hostfile" "$@"
}

cmd_status() {
    if ! cluster_alive; then
        echo "virtual cluster: down"
        return 1
    fi
    echo "virtual cluster: up, link rate $(cat "$VCLUSTER_STATE/rate" 2>/dev/null || echo unlimited)"
    cat "$NODES_FILE"
    if [[ -s $VC_SLURM_CONF ]]; then
        SLURM_CONF=$VC_SLURM_CONF timeout 10 sinfo 2>&1 || true
    fi
}

main() {
    (($#)) || usage
    local command=$1
    shift
    case $command in
        up | down | rate | link | crash)
            # fd 9: every daemon and namespace holder started here closes it (9>&-).
            exec 9>/run/lock/hpcddp-vcluster.lock
            flock 9
            ;;
    esac
    case $command in
        up) cmd_up "$@" ;;
        down)
            check_namespaces
            stop_everything
            log "virtual cluster down"
            ;;
        rate) (($# == 1)) || usage && cmd_rate "$1" ;;
        link) cmd_link "$@" ;;
        crash) cmd_crash "$@" ;;
        env) cat "$VCLUSTER_STATE/env" 2>/dev/null || die "the virtual cluster is not up" ;;
        exec) exec "$HERE/vnode_exec.sh" "$@" ;;
        run) cmd_run "$@" ;;
        status) cmd_status ;;
        *) usage ;;
    esac
}

main "$@"
