"""Ray's AWS bootstrap and node provider against moto's EC2 and IAM (in process): ray-cluster.yaml's
every node type launches, as docs/aws-spot.md sets the account up."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def load(path: str) -> dict:
    return yaml.safe_load((REPO / path).read_text())


def prepared(path: str) -> dict:
    from elastic_gpt.elastic.ray_internals import prepare_cluster_config

    return prepare_cluster_config(copy.deepcopy(load(path)))


def test_aws_bootstrap_and_launch_every_node_type(tmp_path, monkeypatch):
    """Ray's AWS bootstrap + node provider against moto's EC2/IAM: the real launch path."""
    import boto3
    from moto import mock_aws

    monkeypatch.setenv("HOME", str(tmp_path))  # Ray writes the generated key pair to ~/.ssh
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    config = prepared("ray-cluster.yaml")
    with mock_aws():
        iam = boto3.client("iam")
        profiles = {t["node_config"]["IamInstanceProfile"]["Name"]
                    for t in config["available_node_types"].values()}
        for name in profiles:  # what docs/aws-spot.md tells the user to create
            iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")
            iam.create_instance_profile(InstanceProfileName=name)
            iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        # The subnet and the security group that admits itself (EFA), as docs/aws-spot.md
        # creates them, put in place of the file's placeholders.
        ec2 = boto3.client("ec2")
        zone = config["provider"]["availability_zone"]
        subnet = next(s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]
                      if s["AvailabilityZone"] == zone)
        vpc = ec2.describe_subnets(SubnetIds=[subnet])["Subnets"][0]["VpcId"]
        sg = ec2.create_security_group(GroupName="elastic-gpt", Description="efa",
                                       VpcId=vpc)["GroupId"]
        ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=[
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": sg}]}])
        # (moto has no placement groups to create; it takes the name a launch gives.)
        config = yaml.safe_load(yaml.safe_dump(config).replace("subnet-REPLACE-ME", subnet)
                                .replace("sg-REPLACE-ME", sg))

        from elastic_gpt.elastic.ray_internals import aws_node_provider, bootstrap_aws

        booted = bootstrap_aws(config)
        provider = aws_node_provider(booted["provider"], booted["cluster_name"])
        for name, node_type in booted["available_node_types"].items():
            provider.create_node(node_type["node_config"],
                                 {"ray-node-type": "worker", "ray-user-node-type": name}, 1)

        launched = {}
        for reservation in boto3.client("ec2").describe_instances()["Reservations"]:
            for inst in reservation["Instances"]:
                tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                launched[tags["ray-user-node-type"]] = inst
    assert set(launched) == set(config["available_node_types"])
    for name, inst in launched.items():
        node_config = config["available_node_types"][name]["node_config"]
        assert inst["InstanceType"] == node_config["InstanceType"]
        is_spot = "InstanceMarketOptions" in node_config
        assert (inst.get("InstanceLifecycle") == "spot") == is_spot, name
        assert inst["IamInstanceProfile"]["Arn"].endswith(
            "/" + node_config["IamInstanceProfile"]["Name"])
        assert inst["MetadataOptions"]["HttpTokens"] == "required"
        assert inst["SubnetId"] == subnet and inst["Placement"]["AvailabilityZone"] == zone, name
