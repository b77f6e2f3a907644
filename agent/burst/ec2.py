"""The ``ec2`` provisioner: EC2 instances that run an agent from their user-data.

One ``RunInstances`` call per node, from the pool's launch template
(``--option launch_template=lt-... | NAME``) or AMI (``image_id``, with
``instance_type``, ``subnet_id``, ``security_group_ids``, ``instance_profile``,
``key_name``). The user-data installs nothing: the image (or the pool's
``setup`` option, a shell line run first) must provide ``hypermesh``; it then
runs ``hypermesh agent start --pool P --name N [--spot]`` against the pool's
``etcd`` option (the mesh's endpoints as the instance reaches them).

Spot nodes ask for one-time spot capacity through ``InstanceMarketOptions``.
Every instance is tagged ``hypermesh:namespace``, ``hypermesh:pool`` and
``hypermesh:node``; ``terminate`` reads the tags back and refuses an instance
that does not carry ours. Not run against real AWS here, only against a moto
server (tests/burst/test_provision_ec2.py).
"""

from __future__ import annotations

import base64
import logging
import shlex
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from hypermesh.agent.burst.provisioner import CapacityRefused, Context, NodeSpec, ProvisionError
from hypermesh.state.pools import Pool

log = logging.getLogger(__name__)

TAG_NAMESPACE = "hypermesh:namespace"
TAG_POOL = "hypermesh:pool"
TAG_NODE = "hypermesh:node"
# Error codes that mean "no capacity of this kind now", not "your request is wrong".
CAPACITY_ERRORS = frozenset({
    "InsufficientInstanceCapacity",
    "InsufficientHostCapacity",
    "InsufficientCapacity",
    "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow",
    "InsufficientFreeAddressesInSubnet",
})
GONE_STATES = frozenset({"shutting-down", "terminated"})
AGENT_PORT = 7070


def user_data(
    spec: NodeSpec, ctx: Context, etcd: str, setup: str = "", tls_dir: str = ""
) -> str:
    """The boot script of one node: every value shell-quoted. ``tls_dir`` (the pool's
    option): where on the instance the ``setup`` line left ``ca.pem``, ``agent.pem`` and
    ``agent-key.pem`` (an ``--agent`` certificate for the node's name); without it the
    agent serves plaintext on its routable address (``--insecure``, warned about)."""
    args = [
        "hypermesh", "agent", "start", "--etcd", etcd, "--namespace", ctx.namespace,
        "--name", spec.name, "--slots", str(spec.pool.slots),
        "--work-dir", "/var/lib/hypermesh", *spec.agent_args(),
    ]
    if tls_dir:
        security = [f"--tls-{kind}={tls_dir.rstrip('/')}/{file}" for kind, file in
                    (("ca", "ca.pem"), ("cert", "agent.pem"), ("key", "agent-key.pem"))]
    else:
        security = ["--insecure"]
    if ctx.store:
        args += ["--store", ctx.store]
    lines = [
        "#!/bin/bash",
        "set -euo pipefail",
        *([setup] if setup else []),
        "IP=$(hostname -I | cut -d' ' -f1)",
        f'exec {shlex.join(args)} --listen "$IP:{AGENT_PORT}" {shlex.join(security)}',
    ]
    return "\n".join(lines) + "\n"


class Ec2Provisioner:
    def __init__(self, pool: Pool, ctx: Context, client: Any = None) -> None:
        self.pool = pool
        self.ctx = ctx
        opts = pool.options
        self.etcd = opts.get("etcd") or ctx.etcd
        self.client = client or boto3.client(
            "ec2",
            region_name=opts.get("region") or None,
            endpoint_url=opts.get("endpoint") or None,
        )

    def tags(self, spec: NodeSpec) -> list[dict[str, str]]:
        return [
            {"Key": TAG_NAMESPACE, "Value": self.ctx.namespace},
            {"Key": TAG_POOL, "Value": spec.pool.name},
            {"Key": TAG_NODE, "Value": spec.name},
            {"Key": "Name", "Value": spec.name},
        ]

    def request(self, spec: NodeSpec) -> dict[str, Any]:
        """The ``RunInstances`` parameters for one node."""
        opts = self.pool.options
        params: dict[str, Any] = {
            "MinCount": 1,
            "MaxCount": 1,
            "UserData": user_data(spec, self.ctx, self.etcd, opts.get("setup", ""),
                                  opts.get("tls_dir", "")),
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": self.tags(spec)},
                {"ResourceType": "volume", "Tags": self.tags(spec)},
            ],
        }
        template = opts.get("launch_template")
        if template:
            key = "LaunchTemplateId" if template.startswith("lt-") else "LaunchTemplateName"
            params["LaunchTemplate"] = {key: template, "Version": opts.get("version", "$Default")}
        else:
            params["ImageId"] = opts["image_id"]
            params["InstanceType"] = opts.get("instance_type", "m5.large")
        if opts.get("instance_type") and template:
            params["InstanceType"] = opts["instance_type"]
        for option, name in (("subnet_id", "SubnetId"), ("key_name", "KeyName")):
            if opts.get(option):
                params[name] = opts[option]
        if opts.get("security_group_ids"):
            params["SecurityGroupIds"] = opts["security_group_ids"].split(",")
        if opts.get("instance_profile"):
            params["IamInstanceProfile"] = {"Name": opts["instance_profile"]}
        if spec.spot:
            spot_options: dict[str, Any] = {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            }
            if opts.get("max_price"):
                spot_options["MaxPrice"] = opts["max_price"]
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot_options}
        return params

    def launch(self, spec: NodeSpec) -> str:
        try:
            reply = self.client.run_instances(**self.request(spec))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in CAPACITY_ERRORS:
                market = "spot" if spec.spot else "on-demand"
                raise CapacityRefused(f"{market} capacity refused: {code}", spec.spot) from exc
            raise ProvisionError(f"RunInstances for {spec.name}: {exc}") from exc
        except BotoCoreError as exc:
            raise ProvisionError(f"RunInstances for {spec.name}: {exc}") from exc
        instance_id = str(reply["Instances"][0]["InstanceId"])
        log.info("launched %s as %s (%s)", spec.name, instance_id,
                 "spot" if spec.spot else "on-demand")
        return instance_id

    def _describe(self, instance_id: str) -> dict[str, Any] | None:
        try:
            reply = self.client.describe_instances(InstanceIds=[instance_id])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code", "").startswith("InvalidInstanceID"):
                return None
            raise ProvisionError(f"DescribeInstances {instance_id}: {exc}") from exc
        for reservation in reply.get("Reservations", []):
            for instance in reservation.get("Instances", []):
                return dict(instance)
        return None

    def owned(self, instance: dict[str, Any], name: str) -> bool:
        tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
        return tags.get(TAG_NAMESPACE) == self.ctx.namespace and tags.get(TAG_NODE) == name

    def find(self, name: str) -> str:
        """The id of this mesh's live instance of node ``name`` ("" if none), by tags:
        for a record written before its RunInstances answered."""
        try:
            reply = self.client.describe_instances(Filters=[
                {"Name": f"tag:{TAG_NAMESPACE}", "Values": [self.ctx.namespace]},
                {"Name": f"tag:{TAG_NODE}", "Values": [name]},
                {"Name": "instance-state-name", "Values": ["pending", "running", "stopping",
                                                          "stopped"]},
            ])
        except ClientError as exc:
            raise ProvisionError(f"DescribeInstances for {name}: {exc}") from exc
        for reservation in reply.get("Reservations", []):
            for instance in reservation.get("Instances", []):
                return str(instance["InstanceId"])
        return ""

    def terminate(self, name: str, provider_id: str) -> bool:
        provider_id = provider_id or self.find(name)
        if not provider_id:
            return True  # nothing of ours runs under that name
        instance = self._describe(provider_id)
        if instance is None:
            return True
        if not self.owned(instance, name):
            log.warning("not terminating %s: it is not %s of namespace %s",
                        provider_id, name, self.ctx.namespace)
            return False
        if instance.get("State", {}).get("Name") in GONE_STATES:
            return True
        try:
            self.client.terminate_instances(InstanceIds=[provider_id])
        except ClientError as exc:
            raise ProvisionError(f"TerminateInstances {provider_id}: {exc}") from exc
        return True

    def gone(self, name: str, provider_id: str) -> bool:
        instance = self._describe(provider_id)
        return instance is None or instance.get("State", {}).get("Name") in GONE_STATES


def decode_user_data(encoded: str) -> str:
    """User-data as ``DescribeInstanceAttribute`` returns it (base64) -> the script."""
    return base64.b64decode(encoded).decode()
