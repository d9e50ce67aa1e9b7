#!/usr/bin/env bash
# Run a command on a node of the virtual cluster: vnode_exec.sh NODE COMMAND...
#
# NODE is a node name (vnode1) or its IP. The command runs inside the node's network and UTS
# namespaces (its own hostname, interfaces and IP) and sees this host's files, as on a cluster
# with a shared file system. Open MPI uses this script as its rsh agent (virtual_cluster.sh
# exports PRTE_MCA_plm_ssh_agent), passing the remote command as one shell string; several
# arguments are joined the same way ssh joins them.
set -euo pipefail

VCLUSTER_STATE=${VCLUSTER_STATE:-/run/hpcddp-vcluster}

if (($# < 2)); then
    echo "usage: vnode_exec.sh NODE COMMAND..." >&2
    exit 2
fi
node=$1
shift
holder=$(awk -v node="$node" '$1 == node || $2 == node { print $3 }' "$VCLUSTER_STATE/nodes" 2>/dev/null || true)
if [[ -z $holder ]] || ! kill -0 "$holder" 2>/dev/null; then
    echo "vnode_exec.sh: no running virtual node '$node' (see $VCLUSTER_STATE/nodes; start it with virtual_cluster.sh up)" >&2
    exit 255
fi
# ssh semantics: the arguments form one command line for the remote shell.
exec nsenter --target "$holder" --uts --net -- /bin/sh -c "$*"
