"""The one door to Ray's private APIs (ray is pinned to 2.60.* for them).

Every use in elastic-gpt of a Ray API that is not public goes through this module: `ray._private.*`,
`ray._raylet`, the `_internal_kv_*` functions, the generated protobufs, `ray.train.v2._internal.*`,
and the private members of public classes. A Ray upgrade has one file to read, and
`check_ray_internals()` (the launcher calls it before a run) verifies every entry of
`PRIVATE_APIS` and `PRIVATE_MEMBERS`; tests/unit/test_ray_internals.py checks those and `TEST_APIS`
(Ray's cluster tooling, which only the tests of our deploy files use), and that the tables list
exactly what this module imports.

Importing this module imports no Ray: each function imports what it needs, and the Ray Train base
classes (`ScalingPolicy`, `FailurePolicy` and their decisions) load on first access, so the
preemption watcher and the workers' membership thread stay cheap to import.

It reads and writes cluster state and hands out Ray's classes; it knows nothing about runs,
policies or training.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Api:
    """One Ray name this package relies on: where it lives, the members the code uses, and the
    parameters it passes (`params[""]` for the object itself, else for the named member).
    `imported=False`: never imported, only the shape of objects Ray hands us (checked)."""

    module: str
    name: str
    members: tuple[str, ...] = ()
    params: dict[str, tuple[str, ...]] = field(default_factory=dict)
    imported: bool = True

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


_TRAIN = "ray.train.v2._internal.execution"

# Every private name this module imports.
PRIVATE_APIS: tuple[Api, ...] = (
    Api("ray._private.state", "state",
        members=("total_resources_per_node", "available_resources_per_node", "actor_table",
                 # The most of each resource the autoscaler's node types could bring up (the
                 # cluster config it, or KubeRay, publishes in the GCS): GPU nodes not up yet.
                 "get_max_resources_from_cluster_config")),
    Api("ray._private.services", "canonicalize_bootstrap_address_or_die", params={"": ("addr",)}),
    Api("ray._private.services", "get_node_ip_address"),
    Api("ray._raylet", "GcsClient"),
    # The label every node carries with its id: what pins a worker to its node.
    Api("ray._raylet", "RAY_NODE_ID_KEY"),
    # GcsClient forwards attribute access to InnerGcsClient, where its methods are defined.
    Api("ray._raylet", "InnerGcsClient",
        members=("drain_node", "get_draining_nodes", "get_all_node_info", "internal_kv_keys",
                 "internal_kv_multi_get", "get_cluster_resource_state", "get_cluster_status"),
        params={"drain_node": ("node_id", "reason", "reason_message", "deadline_timestamp_ms"),
                "internal_kv_keys": ("prefix", "namespace"),
                "internal_kv_multi_get": ("keys", "namespace"),
                "get_cluster_status": ("timeout_s",)},
        imported=False),
    # The autoscaler's view of each node: its free and total resources (node_resources_in_use).
    Api("ray.core.generated.autoscaler_pb2", "GetClusterResourceStateReply",
        members=("cluster_resource_state",)),
    Api("ray.core.generated.autoscaler_pb2", "NodeState",
        members=("node_id", "available_resources", "total_resources"), imported=False),
    # What the autoscalers report of the launches they have in flight: v2's state in the GCS
    # (its reply read with fields `autoscaling_state.pending_instance_requests[].count` and
    # `.pending_instances[].ip_address`), v1's status record in the key-value store.
    Api("ray.core.generated.autoscaler_pb2", "GetClusterStatusReply",
        members=("autoscaling_state",)),
    Api("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS"),
    Api("ray.core.generated.autoscaler_pb2", "DrainNodeReason",
        members=("Value", "DRAIN_NODE_REASON_PREEMPTION", "DRAIN_NODE_REASON_IDLE_TERMINATION")),
    # A protobuf message: its fields are checked by name (alive_node_labels reads these two).
    Api("ray.core.generated.gcs_pb2", "GcsNodeInfo", members=("ALIVE", "labels", "is_head_node")),
    Api("ray.experimental.internal_kv", "_internal_kv_put",
        params={"": ("key", "value", "overwrite", "namespace")}),
    Api("ray.experimental.internal_kv", "_internal_kv_get", params={"": ("key", "namespace")}),
    Api("ray.experimental.internal_kv", "_internal_kv_del", params={"": ("key", "namespace")}),
    # The driver's settings Ray Train hands its controller and workers (a set: one is added).
    Api("ray.train.v2._internal.constants", "ENV_VARS_TO_PROPAGATE", members=("add",)),
    Api(f"{_TRAIN}.failure_handling", "FailureDecision", members=("RETRY", "RAISE")),
    Api(f"{_TRAIN}.failure_handling", "FailurePolicy", members=("make_decision",),
        params={"__init__": ("failure_config",)}),
    Api(f"{_TRAIN}.scaling_policy", "NoopDecision"),
    Api(f"{_TRAIN}.scaling_policy", "ResizeDecision",
        params={"": ("num_workers", "resources_per_worker")}),
    Api(f"{_TRAIN}.scaling_policy", "ScalingPolicy",
        members=("make_decision_for_non_running_worker_group",
                 "make_decision_for_running_worker_group",
                 "_get_num_workers_for_resource_request", "_maybe_send_resource_request",
                 "after_controller_start"),
        params={"__init__": ("scaling_config",),
                "after_controller_start": ("train_run_context",)}),
    # The controller that takes our policies, and what it passes them (read in policies.py). It
    # starts each group with the per-worker label selectors of the run's ScalingConfig, which
    # the scaling policy sets to pin workers to nodes.
    Api(f"{_TRAIN}.controller", "TrainController", members=("_start_worker_group",),
        params={"__init__": ("scaling_policy", "failure_policy")}, imported=False),
    Api(f"{_TRAIN}.context", "TrainRunContext", members=("scaling_config",), imported=False),
    Api(f"{_TRAIN}.worker_group.state", "WorkerGroupState",
        members=("workers", "placement_group_handle", "num_workers"), imported=False),
    Api(f"{_TRAIN}.worker_group.worker", "Worker", members=("metadata",), imported=False),
    Api(f"{_TRAIN}.worker_group.worker", "ActorMetadata", members=("node_id",), imported=False),
    Api(f"{_TRAIN}.worker_group.placement_group_handle", "PlacementGroupHandle",
        members=("placement_group",), imported=False),
)

# Private Ray tooling only the tests use, to read our deploy files the way `ray up`, KubeRay's
# autoscaler and `ray job submit` do. check_ray_internals() leaves them out: a driver never loads
# them (the AWS ones need boto3); tests/unit/test_ray_internals.py checks them.
TEST_APIS: tuple[Api, ...] = (
    Api("ray.autoscaler._private.util", "prepare_config", params={"": ("config",)}),
    Api("ray.autoscaler._private.util", "validate_config", params={"": ("config",)}),
    Api("ray.autoscaler._private.aws.config", "bootstrap_aws", params={"": ("config",)}),
    Api("ray.autoscaler._private.aws.node_provider", "AWSNodeProvider", members=("create_node",),
        params={"": ("provider_config", "cluster_name")}),
    Api("ray.autoscaler._private.kuberay.autoscaling_config",
        "_derive_autoscaling_config_from_ray_cr", params={"": ("ray_cr",)}),
    Api("ray._private.runtime_env.packaging", "_zip_files",
        params={"": ("path_str", "excludes", "output_path", "include_gitignore")}),
    # Where the autoscaler keeps its node types in the GCS: a test stands in for one.
    Api("ray._raylet", "GCS_AUTOSCALER_CLUSTER_CONFIG_KEY"),
    Api("ray._raylet", "GCS_AUTOSCALER_STATE_NAMESPACE"),
    Api("ray.core.generated.autoscaler_pb2", "ClusterConfig"),  # its fields: the test reads back
    # How autoscaler v2 reports its launches in flight to the GCS: a test stands in for one.
    Api("ray.core.generated.autoscaler_pb2", "AutoscalingState",
        members=("pending_instance_requests", "pending_instances", "autoscaler_state_version")),
    Api("ray._raylet", "InnerGcsClient", members=("report_autoscaling_state",),
        params={"report_autoscaling_state": ("timeout_s",)}, imported=False),
)

# Private members of public Ray classes.
PRIVATE_MEMBERS: tuple[Api, ...] = (
    # The controller reads `label_selector` through `_label_selector_per_worker`: a list is one
    # selector per worker, in rank order.
    Api("ray.train", "ScalingConfig", members=("_resources_per_worker_not_none",
                                               "_label_selector_per_worker", "label_selector")),
    # controller.py overrides it to hand the controller our policies.
    Api("ray.train.torch", "TorchTrainer", members=("_initialize_and_run_controller",)),
)


def __getattr__(name: str):
    """The Ray Train classes policies.py builds on, loaded on first access."""
    if name in ("FailureDecision", "FailurePolicy"):
        from ray.train.v2._internal.execution.failure_handling import (
            FailureDecision,
            FailurePolicy,
        )
        return {"FailureDecision": FailureDecision, "FailurePolicy": FailurePolicy}[name]
    if name in ("NoopDecision", "ResizeDecision", "ScalingPolicy"):
        from ray.train.v2._internal.execution.scaling_policy import (
            NoopDecision,
            ResizeDecision,
            ScalingPolicy,
        )
        return {"NoopDecision": NoopDecision, "ResizeDecision": ResizeDecision,
                "ScalingPolicy": ScalingPolicy}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- GCS: nodes, drains, resources ---------------------------------------------------------------

class Raylet(NamedTuple):
    host: str
    port: int


_gcs_clients: dict[str, object] = {}


def gcs_client(address: str | None = None):
    """A GCS client, one per cluster address: the connected cluster's when address is None and
    this process called ray.init, else `address` (None or "auto": the local `ray start` head)."""
    import ray
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray._raylet import GcsClient

    if address is None and ray.is_initialized():
        address = ray.get_runtime_context().gcs_address
    else:
        address = canonicalize_bootstrap_address_or_die(address or "auto")
    if address not in _gcs_clients:
        _gcs_clients[address] = GcsClient(address=address)
    return _gcs_clients[address]


def draining_nodes(address: str | None = None) -> dict[str, int]:
    """Live `{node_id_hex: deadline_ms}` of nodes being drained (0 = no deadline)."""
    return dict(gcs_client(address).get_draining_nodes())


def alive_nodes(address: str | None = None) -> dict[str, Raylet]:
    """Live `{node_id_hex: Raylet(host, port)}` of the nodes the GCS considers alive."""
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = gcs_client(address).get_all_node_info()
    return {nid.hex(): Raylet(info.node_manager_address, info.node_manager_port)
            for nid, info in infos.items() if info.state == GcsNodeInfo.ALIVE}


def alive_node_labels(address: str | None = None) -> dict[str, tuple[dict[str, str], bool]]:
    """Live `{node_id_hex: (labels, is_head)}` of the alive nodes: the labels `ray start --labels`
    gave each node (and Ray's own `ray.io/*` ones), and whether it is the head."""
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = gcs_client(address).get_all_node_info()
    return {nid.hex(): (dict(info.labels), bool(info.is_head_node))
            for nid, info in infos.items() if info.state == GcsNodeInfo.ALIVE}


def nodes_in_use(address: str | None = None) -> set[str]:
    """Node ids on which anything holds resources now: a task, an actor, a placement group's
    bundle (a Ray Train group keeps its actors and bundles until its controller starts the next
    group). Objects in a node's store are not work: its object store memory is left out."""
    from ray.core.generated.autoscaler_pb2 import GetClusterResourceStateReply

    reply = GetClusterResourceStateReply()
    reply.ParseFromString(gcs_client(address).get_cluster_resource_state())
    return {node.node_id.hex() for node in reply.cluster_resource_state.node_states
            if any(node.available_resources.get(name, 0.0) < total
                   for name, total in node.total_resources.items()
                   if name != "object_store_memory")}


def kv_items_at(address: str | None, namespace: str) -> dict[bytes, bytes]:
    """Every key and value of one namespace of the GCS key-value store at `address`, through a
    GCS client (no ray.init: the Slurm helpers read it from outside the run)."""
    client = gcs_client(address)
    keys = client.internal_kv_keys(b"", namespace=namespace.encode())
    return dict(client.internal_kv_multi_get(keys, namespace=namespace.encode())) if keys else {}


# Ray's drain reasons by the names elastic-gpt uses for them.
DRAIN_REASONS = {"preemption": "DRAIN_NODE_REASON_PREEMPTION",
                 "idle_termination": "DRAIN_NODE_REASON_IDLE_TERMINATION"}


def drain_node(node_id: str, reason: str, message: str, deadline_ms: int,
               address: str | None = None) -> tuple[bool, str]:
    """Ask the GCS to drain a node; returns (accepted, the rejection reason if not)."""
    from ray.core.generated.autoscaler_pb2 import DrainNodeReason

    accepted, rejection = gcs_client(address).drain_node(
        node_id, DrainNodeReason.Value(DRAIN_REASONS[reason]), message, int(deadline_ms))
    return bool(accepted), rejection


def node_ip_address() -> str:
    """This machine's IP as Ray's raylets register it."""
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


def total_resources_per_node() -> dict[str, dict[str, float]]:
    """`{node_id_hex: {resource: total}}` of the alive nodes of the connected cluster."""
    from ray._private.state import state

    return state.total_resources_per_node()


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """`{node_id_hex: {resource: free now}}` of the connected cluster."""
    from ray._private.state import state

    return state.available_resources_per_node()


def live_actors(class_name: str) -> list[tuple[int, str]]:
    """`(pid, node_id_hex)` of the connected cluster's alive actors of one class, read from the
    GCS actor table (no dashboard needed)."""
    from ray._private.state import state

    return [(a["Pid"], a["Address"]["NodeID"]) for a in state.actor_table(None).values()
            if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]


def declared_max_resources() -> dict[str, int]:
    """The most of each resource the cluster's autoscaler could bring up (its node types times
    their max counts), or {} where no autoscaler published a cluster config (a fixed cluster)."""
    from ray._private.state import state

    return dict(state.get_max_resources_from_cluster_config() or {})


AUTOSCALER_STATUS_STALE_S = 60.0
"""Autoscaler v1's status record older than this is a monitor that has stopped: not counted."""


def pending_launches(address: str | None = None) -> int:
    """Nodes the cluster's autoscaler reports as coming: launches requested and not yet made,
    and nodes made whose Ray has not registered yet (by IP: one whose address is an alive node's
    has arrived). 0 where no autoscaler reports (a fixed cluster). Both of Ray's autoscalers are
    read: v2 (KubeRay's, `RAY_enable_autoscaler_v2`) reports its state to the GCS, v1's monitor
    (`ray up`'s) writes a status record to the key-value store every few seconds."""
    import json
    import time

    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    alive_ips = {raylet.host for raylet in alive_nodes(address).values()}
    reply = GetClusterStatusReply()
    reply.ParseFromString(gcs_client(address).get_cluster_status(timeout_s=5))
    state = reply.autoscaling_state
    coming = sum(r.count for r in state.pending_instance_requests)
    coming += sum(1 for i in state.pending_instances if i.ip_address not in alive_ips)
    raw = kv_get(DEBUG_AUTOSCALING_STATUS.encode(), None)
    status = json.loads(raw) if raw else {}
    if time.time() - float(status.get("time", 0)) < AUTOSCALER_STATUS_STALE_S:
        report = status.get("autoscaler_report") or {}
        coming += sum((report.get("pending_launches") or {}).values())
        coming += sum(1 for ip, *_ in report.get("pending_nodes") or [] if ip not in alive_ips)
    return coming


def node_id_label() -> str:
    """The label under which every node carries its node id (`ray.io/node-id`)."""
    from ray._raylet import RAY_NODE_ID_KEY

    return RAY_NODE_ID_KEY


# ---- GCS key-value store -------------------------------------------------------------------------

def kv_put(key: bytes, value: bytes, namespace: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_get(key: bytes, namespace: str) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)


def kv_del(key: bytes, namespace: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=namespace)


# ---- Ray Train ---------------------------------------------------------------------------------

def resources_per_worker(scaling_config) -> dict[str, float]:
    """A ScalingConfig's per-worker resources with Ray's defaults filled in."""
    return scaling_config._resources_per_worker_not_none


# ---- Ray's cluster tooling, for the tests of our deploy files (TEST_APIS) ----------------------

def publish_node_types(node_types: dict[str, tuple[dict[str, float], int]] | None) -> None:
    """Write the record of node types an autoscaler (or KubeRay's) keeps in the GCS, name ->
    (resources, max count), as a test's stand-in for one; None removes it."""
    from ray._raylet import GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, GCS_AUTOSCALER_STATE_NAMESPACE
    from ray.core.generated.autoscaler_pb2 import ClusterConfig

    if node_types is None:
        kv_del(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), GCS_AUTOSCALER_STATE_NAMESPACE)
        return
    config = ClusterConfig()
    for name, (resources, max_count) in node_types.items():
        group = config.node_group_configs.add(name=name, max_count=max_count)
        for key, amount in resources.items():
            group.resources[key] = int(amount)
    kv_put(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), config.SerializeToString(),
           GCS_AUTOSCALER_STATE_NAMESPACE)


def report_pending_launches(count: int) -> None:
    """Report `count` node launches in flight to the GCS as autoscaler v2 does (each report
    replaces the last), as a test's stand-in for an autoscaler bringing nodes up."""
    from ray.core.generated.autoscaler_pb2 import AutoscalingState, GetClusterStatusReply

    client = gcs_client()
    current = GetClusterStatusReply()
    current.ParseFromString(client.get_cluster_status(timeout_s=5))
    state = AutoscalingState(
        autoscaler_state_version=current.autoscaling_state.autoscaler_state_version + 1)
    if count:
        state.pending_instance_requests.add(instance_type_name="test-node",
                                            ray_node_type_name="test-node", count=count)
    client.report_autoscaling_state(state.SerializeToString(), timeout_s=5)


def report_autoscaler_v1_status(pending_launches: dict[str, int],
                                pending_nodes: list[tuple[str, str, str]], at: float) -> None:
    """Write autoscaler v1's status record as its monitor does (`ray status` reads it), with
    the launches and nodes in flight, as a test's stand-in for one; `at`: its time."""
    import json

    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS

    status = {"time": at, "autoscaler_report": {"pending_launches": pending_launches,
                                                "pending_nodes": [list(n) for n in pending_nodes]}}
    kv_put(DEBUG_AUTOSCALING_STATUS.encode(), json.dumps(status).encode(), None)


def prepare_cluster_config(config: dict) -> dict:
    """A cluster yaml as `ray up` reads it: defaults filled in, then schema and cross-field checks
    (raise on a bad file). Returns the filled-in copy."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def kuberay_autoscaling_config(ray_cluster: dict) -> dict:
    """The autoscaling config Ray's KubeRay autoscaler derives from a RayCluster resource."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    return _derive_autoscaling_config_from_ray_cr(ray_cluster)


def bootstrap_aws(config: dict) -> dict:
    """`ray up`'s AWS bootstrap of a prepared cluster config (IAM, subnets, security groups)."""
    from ray.autoscaler._private.aws.config import bootstrap_aws as bootstrap

    return bootstrap(config)


def aws_node_provider(provider_config: dict, cluster_name: str):
    """The node provider `ray up` launches AWS instances with."""
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    return AWSNodeProvider(provider_config, cluster_name)


def zip_working_dir(path: str, excludes: list[str], output_path: str) -> None:
    """What `ray job submit --working-dir` would upload, as a zip (honouring .gitignore)."""
    from ray._private.runtime_env.packaging import _zip_files

    _zip_files(path, excludes, output_path, include_gitignore=True)


def propagate_to_ray_train(env_var: str) -> None:
    """Have Ray Train hand the driver's `env_var` to its controller and workers, as it does its
    own RAY_TRAIN_* settings: for a setting Ray reads in the controller but does not forward."""
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE
    ENV_VARS_TO_PROPAGATE.add(env_var)


# ---- the check -----------------------------------------------------------------------------------

def check_ray_internals() -> list[str]:
    """Fail loudly if a Ray API this package relies on is gone or changed shape. Returns the
    names it verified."""
    import ray

    problems = []
    for api in PRIVATE_APIS + PRIVATE_MEMBERS:
        problems += api_problems(api)
    if problems:
        raise RuntimeError(f"ray {ray.__version__}: Ray internals changed: " + "; ".join(problems)
                           + ". elastic-gpt pins ray==2.60.*")
    return [api.qualname for api in PRIVATE_APIS + PRIVATE_MEMBERS]


def api_problems(api: Api) -> list[str]:
    """What is wrong with one entry on this Ray version (empty when it has the shape we use)."""
    import importlib

    try:
        obj = getattr(importlib.import_module(api.module), api.name)
    except (ImportError, AttributeError) as e:
        return [f"{api.qualname} is gone ({e})"]
    problems = []
    # A protobuf message's fields are in its descriptor, not attributes of its class.
    fields = getattr(getattr(obj, "DESCRIPTOR", None), "fields_by_name", {})
    for member in api.members:
        if not (hasattr(obj, member) or member in getattr(obj, "__dataclass_fields__", {})
                or member in fields):
            problems.append(f"{api.qualname}.{member} is gone")
    for member, names in api.params.items():
        target = getattr(obj, member, None) if member else obj
        try:
            have = inspect.signature(target).parameters
        except (TypeError, ValueError):
            problems.append(f"{api.qualname}{'.' + member if member else ''} has no signature")
            continue
        problems += [f"{api.qualname}{'.' + member if member else ''} has no {n!r} parameter"
                     for n in names if n not in have]
    return problems
