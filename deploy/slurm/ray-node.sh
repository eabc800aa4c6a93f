#!/usr/bin/env bash
# One Ray node of an elastic-gpt Slurm job, started by `srun` (one task per node) from
# elastic-gpt.sbatch and grow.sbatch. docs/slurm.md explains the layout.
#
#   ray-node.sh head RUN_JOB GCS_PORT DASHBOARD_PORT
#       the run's head: GCS, dashboard, the driver and Ray Train's controller; no CPU or GPU for
#       training, so that draining every worker leaves the run nowhere to restart
#   ray-node.sh worker RUN_JOB HEAD_IP:GCS_PORT
#       a worker: this node's CPUs and GPUs, with this node's own fabric settings (fabric.sh)
#   ray-node.sh ip
#       print the IPv4 address this node's Ray registers with
#
# RUN_JOB is the Slurm job id of the run's main job; the node's own job is SLURM_JOB_ID. Both
# become node labels, by which the warning's drain picks nodes (never by IP: the head and a worker
# share the first node's address). `ray start --block` stays in the foreground, so the step lives
# as long as the node. Never Ray's own stop command: it stops every Ray of this user on the node, other jobs'
# too; the job's end stops its steps.
#
# Settings (the job's environment reaches every step):
#   RAY_AUTH_MODE=token, RAY_AUTH_TOKEN   the run's token (the batch script makes one per job)
#   ELASTIC_GPT_PYTHON                    the Python with elastic-gpt installed (default: python)
#   ELASTIC_GPT_RAY_IFACE                 register with this interface's address (default: the
#                                         address Slurm has for the node, its NodeAddr)
#   ELASTIC_GPT_RAY_CPUS                  CPUs a worker offers (default: SLURM_CPUS_ON_NODE)
#   ELASTIC_GPT_RAY_OBJECT_STORE_BYTES    object store size (default: Ray's, 30% of memory)
#   ELASTIC_GPT_RAY_TMP                   parent of the node's Ray temp dir (default: /tmp)
#   ELASTIC_GPT_FABRIC_ENV                a site's file of fabric settings, read after fabric.sh
set -euo pipefail

usage() {
    echo "ray-node.sh: error: $1; usage: ray-node.sh head RUN_JOB GCS_PORT DASHBOARD_PORT" \
         "| worker RUN_JOB HEAD_IP:GCS_PORT | ip" >&2
    exit 2
}

node_ip() {
    local addr
    if [[ -n ${ELASTIC_GPT_RAY_IFACE:-} ]]; then
        addr=$(ip -4 -o addr show dev "$ELASTIC_GPT_RAY_IFACE" | awk '{split($4, a, "/"); print a[1]; exit}')
        [[ -n $addr ]] || usage "ELASTIC_GPT_RAY_IFACE=$ELASTIC_GPT_RAY_IFACE has no IPv4 address on $(hostname)"
        echo "$addr"
        return
    fi
    [[ -n ${SLURMD_NODENAME:-} ]] || usage "runs inside a Slurm job (SLURMD_NODENAME is unset)"
    addr=$(scontrol show node "$SLURMD_NODENAME" | grep -oE 'NodeAddr=[^ ]+' | cut -d= -f2)
    if [[ $addr =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then
        echo "$addr"
    else
        getent ahostsv4 "$addr" | awk '{print $1; exit}'
    fi
}

role=${1:-}
case $role in
    ip) node_ip; exit 0 ;;
    head) [[ $# -eq 4 && $3 =~ ^[0-9]+$ && $4 =~ ^[0-9]+$ ]] \
              || usage "head takes RUN_JOB GCS_PORT DASHBOARD_PORT" ;;
    worker) [[ $# -eq 3 && $3 =~ ^[^:]+:[0-9]+$ ]] || usage "worker takes RUN_JOB HEAD_IP:GCS_PORT" ;;
    *) usage "unknown role '${role}'" ;;
esac
run_job=$2
[[ $run_job =~ ^[0-9]+$ ]] || usage "RUN_JOB '$run_job' is not a Slurm job id"
[[ -n ${SLURM_JOB_ID:-} ]] || usage "it runs inside a Slurm step (srun)"
[[ -n ${RAY_AUTH_TOKEN:-} ]] || usage "the run token is missing: the batch script exports RAY_AUTH_TOKEN"
export RAY_AUTH_MODE=token
python=${ELASTIC_GPT_PYTHON:-python}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ip=$(node_ip)
[[ -n $ip ]] || usage "no address for ${SLURMD_NODENAME}; set ELASTIC_GPT_RAY_IFACE"
# Per job, per run of it (a requeued job reruns under the same id) and per node: a fresh session
# folder, and several raylets on one host never share one. Short: Ray's socket paths must stay
# under 107 bytes.
tmp=${ELASTIC_GPT_RAY_TMP:-/tmp}/egpt-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}-${SLURMD_NODENAME}-$role
mkdir -p "$tmp"
labels="elastic-gpt/slurm-job=$SLURM_JOB_ID,elastic-gpt/slurm-run=$run_job,elastic-gpt/node-role=$role"
if [[ $role == head ]]; then
    # A lost node is declared dead after ~1.5 s instead of Ray's ~30 s (as the cloud clusters run).
    health='{"health_check_period_ms":500,"health_check_timeout_ms":500,"health_check_failure_threshold":3}'
    node=(--head --port="$3" --num-cpus=0 --num-gpus=0 --include-dashboard=true
          --dashboard-host=127.0.0.1 --dashboard-port="$4" --labels="$labels"
          --system-config="$health"
          --object-store-memory="${ELASTIC_GPT_RAY_OBJECT_STORE_BYTES:-200000000}")
else
    # This node's fabric settings, before its raylet starts: its workers inherit them.
    # shellcheck source=deploy/slurm/fabric.sh
    source "$here/fabric.sh"
    if [[ -n ${ELASTIC_GPT_FABRIC_ENV:-} ]]; then
        # shellcheck source=/dev/null
        source "$ELASTIC_GPT_FABRIC_ENV"
    fi
    node=(--address="$3" --num-cpus="${ELASTIC_GPT_RAY_CPUS:-${SLURM_CPUS_ON_NODE:-1}}"
          --labels="$labels,elastic-gpt/slurm-node=$SLURMD_NODENAME")
    if [[ -n ${ELASTIC_GPT_RAY_OBJECT_STORE_BYTES:-} ]]; then
        node+=(--object-store-memory="$ELASTIC_GPT_RAY_OBJECT_STORE_BYTES")
    fi
fi

# Ray gives a starting node 30 s to register with the GCS (fixed in Ray 2.60), which a busy
# head can miss; the allocation is still ours, so a start that failed is tried again. A node that
# ran and then ended is not started again: the job's end, or a fault the run reacts to.
for try in 1 2 3; do
    # Every port this node listens on, free on this host now: other jobs (and other Ray
    # clusters) may share the node.
    mapfile -t port < <("$python" -m elastic_gpt.elastic.slurm free-ports 7)
    started=$SECONDS
    rc=0
    ray start --block --disable-usage-stats --node-ip-address="$ip" --temp-dir="$tmp" \
        --node-manager-port="${port[0]}" --object-manager-port="${port[1]}" \
        --runtime-env-agent-port="${port[2]}" --metrics-export-port="${port[3]}" \
        --dashboard-agent-grpc-port="${port[4]}" --dashboard-agent-listen-port="${port[5]}" \
        --ray-client-server-port="${port[6]}" "${node[@]}" || rc=$?
    ((rc != 0 && SECONDS - started < 90)) || exit "$rc"
    echo "[elastic-gpt] ray start failed on ${SLURMD_NODENAME} (try $try of 3, exit $rc)" >&2
done
exit "$rc"
