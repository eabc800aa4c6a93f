"""Every way to deploy elastic-gpt is checked by the code that will consume it.

- Cluster-launcher files (ray-cluster.yaml, deploy/gcp-cluster.yaml): Ray's own
  ``prepare_config`` + ``validate_config`` (ray-schema.json and its cross-field checks). (The AWS
  file's launch through Ray's AWS bootstrap and node provider against moto's EC2 is
  tests/integration/test_cluster_configs.py.)
- KubeRay manifests: no PyPI package ships the KubeRay CRD schemas, so the fields the
  operator requires (ray.io/v1) are checked here by hand; then Ray's own KubeRay autoscaler code
  derives its autoscaling config from the RayCluster and Ray's validator checks that.
- Every training config a deploy file, the docs or jobs/ mentions exists and loads through
  ``elastic_gpt.config.load_config``; the runtime env parses the way `ray job submit` parses it.
"""

from __future__ import annotations

import copy
import re
import shlex
import zipfile
from pathlib import Path

import pytest
import yaml

from elastic_gpt.config import load_config
from elastic_gpt.elastic.preemption import build_parser

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_FILES = ["ray-cluster.yaml", "deploy/gcp-cluster.yaml"]
KUBERAY_FILES = ["deploy/kuberay/raycluster.yaml", "deploy/kuberay/rayjob.yaml"]
DEPLOY_FILES = LAUNCHER_FILES + KUBERAY_FILES
TRAINING_CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "jobs/configs").glob("*.yaml"))
# An access key id, a secret key assignment, or a key file in any deploy file is a leak.
SECRET = re.compile(r"AKIA[0-9A-Z]{16}|aws_secret_access_key|aws_access_key_id|"
                    r"private_key_id|BEGIN [A-Z ]*PRIVATE KEY", re.IGNORECASE)


def load(path: str) -> dict:
    return yaml.safe_load((REPO / path).read_text())


def prepared(path: str) -> dict:
    from elastic_gpt.elastic.ray_internals import prepare_cluster_config

    return prepare_cluster_config(copy.deepcopy(load(path)))


def commands(config: dict, key: str) -> str:
    return "\n".join(config.get(key, []))


def watcher_args(command_text: str) -> list:
    """The `python -m elastic_gpt.elastic.preemption ...` arguments in a shell command list."""
    found = []
    for line in command_text.splitlines():
        if "elastic_gpt.elastic.preemption" not in line:
            continue
        words = shlex.split(line.split("elastic_gpt.elastic.preemption", 1)[1].split(">")[0])
        found.append(build_parser().parse_args(words))
    return found


# ----------------------------------------------------------------- cluster launcher


@pytest.mark.parametrize("path", LAUNCHER_FILES)
def test_launcher_file_passes_rays_validation(path):
    config = prepared(path)
    types = config["available_node_types"]
    head = config["head_node_type"]
    assert types[head]["max_workers"] == 0
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert len(gpu_types) >= 2 and head not in gpu_types
    # Ray's validator checks the global cap against min_workers; also check it lets every
    # type reach its own max, so the per-type limits are the real ones.
    assert config["max_workers"] >= sum(t["max_workers"] for t in gpu_types.values())


@pytest.mark.parametrize("path", DEPLOY_FILES)
def test_no_credentials_in_deploy_files(path):
    text = (REPO / path).read_text()
    assert not SECRET.search(text), f"{path} contains something that looks like a credential"


def test_aws_cluster_shape():
    config = prepared("ray-cluster.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["node_config"]
    assert "InstanceMarketOptions" not in head, "the head must be on-demand"
    spot = [n for n, t in types.items()
            if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"]
    ondemand_gpu = [n for n, t in types.items() if t["resources"].get("GPU")
                    and "InstanceMarketOptions" not in t["node_config"]]
    assert spot and ondemand_gpu, "GPU workers on spot plus an on-demand GPU fallback"
    for name, t in types.items():
        nc = t["node_config"]
        assert "IamInstanceProfile" in nc, f"{name}: S3 through an instance profile, no keys"
        assert nc["MetadataOptions"]["HttpTokens"] == "required", f"{name}: IMDSv2 only"
    for name in spot:
        assert types[name]["max_workers"] >= max(1, types[name]["min_workers"])
    # Dashboard bound to the head's loopback: reachable only through `ray dashboard`.
    head_start = commands(config, "head_start_ray_commands")
    ray_start = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert len(ray_start) == 1 and "--dashboard-host=127.0.0.1" in ray_start[0]
    assert "pip install" in commands(config, "setup_commands")
    assert "s3://" in head_start  # MLflow artifacts on S3


# EFA interfaces per instance type (one per network card): AWS's "Supported instance types" table.
EFA_CARDS = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5en.48xlarge": 16}


def test_aws_gpu_workers_get_the_fabric():
    """One zone, a cluster placement group and every EFA interface for the p4d/p5 types, EFA
    inside their containers (devices, locked memory, the host's OFI plugin, FI_* settings), and
    NCCL pointed at the plugin when Ray starts."""
    config = prepared("ray-cluster.yaml")
    assert "," not in config["provider"]["availability_zone"], "one zone"
    efa_types = {n: t for n, t in config["available_node_types"].items()
                 if t["node_config"]["InstanceType"] in EFA_CARDS}
    assert efa_types, "the GPU workhorse types have EFA"
    for name, t in efa_types.items():
        nc = t["node_config"]
        assert nc["Placement"]["GroupName"], name
        cards = EFA_CARDS[nc["InstanceType"]]
        nics = nc["NetworkInterfaces"]
        assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(cards)), name
        assert all(n["InterfaceType"] == "efa" for n in nics), name
        assert [n["DeviceIndex"] for n in nics if n["NetworkCardIndex"] == 0] == [0], name
        assert len({n["SubnetId"] for n in nics}) == 1, f"{name}: one subnet, in the one zone"
        options = " ".join(t["docker"]["worker_run_options"])
        for needed in ("--ulimit memlock=-1:-1", "/dev/infiniband/uverbs", "/opt/amazon:",
                       "FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1"):
            assert needed in options, (name, needed)
    worker_start = commands(config, "worker_start_ray_commands")
    assert "/opt/amazon/ofi-nccl/lib" in worker_start.split("ray start")[0]


@pytest.mark.parametrize("path,provider", [("ray-cluster.yaml", "aws"),
                                           ("deploy/gcp-cluster.yaml", "gcp")])
def test_every_worker_starts_the_spot_watcher(path, provider):
    config = prepared(path)
    worker_start = commands(config, "worker_start_ray_commands")
    parsed = watcher_args(worker_start)
    assert len(parsed) == 1, "exactly one watcher per worker node"
    args = parsed[0]
    assert args.provider == provider
    assert args.address == "$RAY_HEAD_IP:6379"
    assert 0 < args.poll_s <= 5
    # Started after `ray start` joins the node, in the background (the command must return).
    assert worker_start.index("ray start") < worker_start.index("elastic_gpt.elastic.preemption")
    assert re.search(r"elastic_gpt\.elastic\.preemption[^\n]*&", worker_start.replace("\n", " "))
    assert not watcher_args(commands(config, "head_start_ray_commands")), "head is on-demand"


def test_gcp_cluster_shape():
    config = prepared("deploy/gcp-cluster.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["node_config"]
    assert head.get("scheduling", {}).get("provisioningModel", "STANDARD") == "STANDARD"
    spot = ondemand = 0
    for name, t in types.items():
        nc = t["node_config"]
        assert nc["machineType"] and nc["disks"][0]["boot"], name
        if not t["resources"].get("GPU"):
            continue
        sched = nc["scheduling"]
        assert isinstance(sched, dict) and sched["onHostMaintenance"] == "TERMINATE", \
            f"{name}: GPU VMs cannot live-migrate"
        assert nc["serviceAccounts"][0]["email"].endswith(".iam.gserviceaccount.com")
        spot += sched.get("provisioningModel") == "SPOT"
        ondemand += sched.get("provisioningModel") == "STANDARD"
    assert spot >= 1 and ondemand >= 1
    assert "--dashboard-host=127.0.0.1" in commands(config, "head_start_ray_commands")


# ----------------------------------------------------------------- KubeRay


def _pod_specs(cluster_spec: dict):
    yield "head", cluster_spec["headGroupSpec"]["template"]["spec"]
    for group in cluster_spec["workerGroupSpecs"]:
        yield group["groupName"], group["template"]["spec"]


def check_raycluster_spec(spec: dict) -> None:
    """The fields the KubeRay operator (ray.io/v1 CRD) requires, and their types."""
    assert isinstance(spec["headGroupSpec"]["template"]["spec"]["containers"], list)
    assert isinstance(spec["headGroupSpec"].get("rayStartParams", {}), dict)
    assert all(isinstance(v, str) for v in spec["headGroupSpec"].get("rayStartParams", {}).values())
    names = set()
    for group in spec["workerGroupSpecs"]:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", group["groupName"])
        assert group["groupName"] not in names
        names.add(group["groupName"])
        assert isinstance(group["rayStartParams"], dict)  # required by operators before 1.1
        lo, hi = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        assert 0 <= lo <= group.get("replicas", lo) <= hi
    for where, pod in _pod_specs(spec):
        assert pod["containers"], where
        for c in pod["containers"]:
            assert c["name"] and c["image"], f"{where}: every container needs name and image"
            for key in ("requests", "limits"):
                assert all(isinstance(v, str) for v in c.get("resources", {}).get(key, {}).values()
                           ), f"{where}/{c['name']}: quantities are strings"
    assert spec.get("headGroupSpec", {}).get("serviceType", "ClusterIP") == "ClusterIP", \
        "the dashboard must not be exposed outside the cluster"


@pytest.mark.parametrize("path,key", [("deploy/kuberay/raycluster.yaml", "spec"),
                                      ("deploy/kuberay/rayjob.yaml", "rayClusterSpec")])
def test_kuberay_gpu_workers_request_the_fabric(path, key):
    """Every GPU container asks the EFA device plugin for the node's interfaces (requests equal
    to limits, as extended resources must be), may lock memory, and points NCCL at EFA."""
    doc = load(path)
    spec = doc["spec"][key] if key != "spec" else doc["spec"]
    gpu_containers = [c for _, pod in _pod_specs(spec) for c in pod["containers"]
                      if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
    assert gpu_containers
    for c in gpu_containers:
        res = c["resources"]
        assert int(res["limits"]["vpc.amazonaws.com/efa"]) >= 1
        assert res["requests"]["vpc.amazonaws.com/efa"] == res["limits"]["vpc.amazonaws.com/efa"]
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["FI_PROVIDER"] == "efa" and "/opt/amazon/ofi-nccl/lib" in env["LD_LIBRARY_PATH"]


def test_kuberay_raycluster_manifest():
    doc = load("deploy/kuberay/raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    check_raycluster_spec(doc["spec"])
    assert doc["spec"]["rayVersion"].startswith("2.60")

    # Each worker pod runs the watcher as a sidecar reacting to SIGTERM within the grace period.
    for group in doc["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        ray_container = pod["containers"][0]  # KubeRay runs Ray in the first container
        assert ray_container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        (sidecar,) = [c for c in pod["containers"]
                      if "elastic_gpt.elastic.preemption" in c.get("command", [])]
        args = build_parser().parse_args(sidecar["args"])
        assert args.provider == "none"
        assert args.sigterm_deadline_s < pod["terminationGracePeriodSeconds"]
        assert args.address == "$(RAY_CLUSTER_NAME)-head-svc:6379"
        env = {e["name"]: e for e in sidecar["env"]}
        assert env["RAY_CLUSTER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['ray.io/cluster']"


def test_kuberay_autoscaling_config_passes_rays_validation():
    """Ray's own KubeRay autoscaler turns the RayCluster into an autoscaling config."""
    from elastic_gpt.elastic.ray_internals import kuberay_autoscaling_config, prepare_cluster_config

    doc = load("deploy/kuberay/raycluster.yaml")
    doc["metadata"]["namespace"] = "default"
    config = kuberay_autoscaling_config(doc)
    prepare_cluster_config(config)
    types = config["available_node_types"]
    assert types["gpu-spot"]["resources"]["GPU"] == 8
    assert types["gpu-spot"]["min_workers"] == 1 and types["gpu-ondemand"]["min_workers"] == 0
    assert "GPU" not in types["headgroup"]["resources"]


def test_kuberay_rayjob_manifest():
    from ray.runtime_env import RuntimeEnv

    doc = load("deploy/kuberay/rayjob.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    spec = doc["spec"]
    assert spec["entrypoint"].startswith("python ")
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "SidecarMode")
    assert spec["backoffLimit"] >= 1, "a dead driver is resubmitted and resumes"
    RuntimeEnv(**yaml.safe_load(spec["runtimeEnvYAML"]))
    check_raycluster_spec(spec["rayClusterSpec"])
    assert spec["rayClusterSpec"] == load("deploy/kuberay/raycluster.yaml")["spec"], \
        "rayjob.yaml's cluster and raycluster.yaml drifted apart"


# ----------------------------------------------------------------- training configs


def referenced_configs() -> set:
    """jobs/configs/*.yaml named anywhere in the deploy files, the docs and jobs/."""
    texts = [(REPO / p).read_text() for p in DEPLOY_FILES]
    texts += [p.read_text() for p in (REPO / "docs").glob("*.md")]
    texts += [p.read_text() for p in (REPO / "jobs").glob("*.py")]
    return {m for t in texts for m in re.findall(r"jobs/configs/[\w.-]+\.yaml", t)}


def test_referenced_training_configs_exist():
    refs = referenced_configs()
    assert "jobs/configs/gpt2-124m.yaml" in refs
    missing = sorted(r for r in refs if not (REPO / r).is_file())
    assert not missing, f"deploy files or docs name configs that do not exist: {missing}"


@pytest.mark.parametrize("path", TRAINING_CONFIGS)
def test_training_config_loads(path):
    cfg = load_config(str(REPO / path))
    assert cfg.run.name and cfg.data.path


GPU_PRESETS = ["jobs/configs/gpt2-124m.yaml", "jobs/configs/gpt2-350m.yaml",
               "jobs/configs/gpt2-1.5b.yaml"]


@pytest.mark.parametrize("path", GPU_PRESETS)
def test_gpu_presets_are_realistic(path):
    cfg = load_config(str(REPO / path))
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    assert 0.5e6 <= tokens_per_step <= 1.1e6  # GPT-2/GPT-3 batch sizes
    assert cfg.train.warmup_steps >= 1000 and cfg.train.min_lr == pytest.approx(cfg.train.lr / 10)
    assert cfg.data.path.startswith("s3://") and cfg.checkpoint.path.startswith("s3://")
    assert cfg.checkpoint.async_save and cfg.scaling.use_gpu is True
    assert cfg.train.dtype == "bfloat16"
    # Spot: a checkpoint every few minutes of work, so an un-noticed loss costs minutes.
    assert cfg.checkpoint.every_steps <= 500
    # One GPU family per run, which the AWS cluster can hold min_workers of from its spot types
    # alone.
    types = prepared("ray-cluster.yaml")["available_node_types"]
    family = f"accelerator_type:{cfg.scaling.accelerator_type}"
    spot_gpus = sum(t["resources"].get("GPU", 0) * t["max_workers"] for t in types.values()
                    if "InstanceMarketOptions" in t["node_config"] and family in t["resources"])
    assert cfg.scaling.min_workers <= spot_gpus


def test_runtime_env_parses_like_ray_job_submit(tmp_path):
    """`ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml`, up to the upload."""
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    from elastic_gpt.elastic.ray_internals import zip_working_dir

    env = parse_runtime_env_args(runtime_env=str(REPO / "jobs/runtime_env.yaml"),
                                 working_dir=str(REPO))
    RuntimeEnv(**env)
    assert "pip" not in env and "conda" not in env, "the cluster image has the package"
    assert all(isinstance(v, str) for v in env["env_vars"].values())
    # What would be uploaded: the code and configs, never environments, data or run outputs.
    out = tmp_path / "wd.zip"
    zip_working_dir(str(REPO), env["excludes"], str(out))
    names = zipfile.ZipFile(out).namelist()
    assert "jobs/pretrain.py" in names and "jobs/configs/gpt2-124m.yaml" in names
    # The excludes are gitignore patterns: the repository's data folder goes, the package's
    # data layer (elastic_gpt/data) stays.
    assert "elastic_gpt/data/manifest.py" in names
    for bad in (".venv/", ".git/", "data/", "runs/", ".ray_tmp/"):
        assert not any(n.startswith(bad) for n in names), bad
    assert out.stat().st_size < 50 * 2**20
