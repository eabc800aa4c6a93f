# shellcheck shell=bash
# The fabric settings of THIS node, for NCCL in the training workers its raylet starts. Sourced by
# ray-node.sh on every worker node, of the main job and of grow jobs alike, before `ray start`:
# the raylet and every worker it starts inherit them. Each node finds its own, so a node of a
# second allocation with other HCAs gets its own names, never the head's (the batch script keeps
# the driver from forwarding its NCCL_* and FI_* to the workers for the same reason).
#
# What is set, only where the job's environment has not set it already:
#   NCCL_IB_HCA          the active InfiniBand ports of this node, "=mlx5_0:1,mlx5_1:1" (an exact
#                        list: "=" stops NCCL taking mlx5_1 for a prefix of mlx5_10); ports that are
#                        down and Ethernet (RoCE) ports are left out
#   NCCL_SOCKET_IFNAME   the interface holding this node's Ray address: NCCL's bootstrap (and its
#                        socket transport, should it fall back to one) goes where Ray's traffic goes
# What is reported, in one line on the job's log:
#   GPUDirect RDMA       whether the nvidia_peermem module is loaded (without it, or DMA-BUF, NCCL
#                        stages every message through host memory)
#   SHARP                whether NCCL's SHARP plugin (libnccl-net.so, HPC-X's nccl-rdma-sharp
#                        plugins) is on LD_LIBRARY_PATH; in-network reductions stay off unless the
#                        site turns them on (NCCL_COLLNET_ENABLE=1), because only the site knows
#                        whether its switches run the aggregation manager
# A site sets anything else (NCCL_IB_GID_INDEX for RoCE, NCCL_NET_GDR_LEVEL, NCCL_COLLNET_ENABLE,
# SHARP_COLL_*, UCX_*, a node-type switch on $(hostname)) in its own file, ELASTIC_GPT_FABRIC_ENV,
# which ray-node.sh sources after this one. docs/slurm.md lists them.
#
# ELASTIC_GPT_SYSFS: where sysfs is (default /sys): a test points it at a tree of its own.

elastic_gpt_fabric() {
    local sysfs=${ELASTIC_GPT_SYSFS:-/sys} ip=$1 hcas=() port dev num
    for port in "$sysfs"/class/infiniband/*/ports/*; do
        [[ -r $port/state && -r $port/link_layer ]] || continue
        grep -q ACTIVE "$port/state" || continue
        [[ $(<"$port/link_layer") == InfiniBand ]] || continue
        num=${port##*/}
        dev=${port%/ports/*}
        hcas+=("${dev##*/}:$num")
    done
    local joined=""
    if ((${#hcas[@]})); then
        joined=$(IFS=,; echo "${hcas[*]}")
        : "${NCCL_IB_HCA:==$joined}"
        export NCCL_IB_HCA
    fi
    if [[ -z ${NCCL_SOCKET_IFNAME:-} ]]; then
        local ifname
        ifname=$(ip -4 -o addr show 2>/dev/null | awk -v ip="$ip" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')
        if [[ -n $ifname ]]; then
            export NCCL_SOCKET_IFNAME=$ifname
        fi
    fi
    local gdr=no sharp=no dir
    if [[ -d $sysfs/module/nvidia_peermem || -d $sysfs/module/nv_peer_mem ]]; then
        gdr=yes
    fi
    local IFS=:
    for dir in ${LD_LIBRARY_PATH:-}; do
        if [[ -n $dir && -e $dir/libnccl-net.so ]]; then
            sharp="plugin in $dir"
        fi
    done
    if ((${#hcas[@]})); then
        echo "[elastic-gpt] fabric on $(hostname) (${SLURMD_NODENAME:-}): NCCL_IB_HCA=\"$NCCL_IB_HCA\"" \
             "NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} GPUDirect-RDMA=$gdr SHARP=$sharp" >&2
    else
        echo "[elastic-gpt] fabric on $(hostname) (${SLURMD_NODENAME:-}): no active InfiniBand port" \
             "under $sysfs/class/infiniband: NCCL will use sockets" \
             "(NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-})" >&2
    fi
}

elastic_gpt_fabric "$ip"
