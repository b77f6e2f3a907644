"""The ec2 provisioner against a real local moto server (``moto[server]``): the
RunInstances requests, ownership on scale-down, and the on-demand fallback.

moto has no switch to refuse capacity, so the refusal test registers a botocore
``before-call`` hook on the test's client that raises ``InsufficientInstanceCapacity``
for spot requests only; every other call reaches the moto server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from hypermesh.agent.burst.duty import BurstDuty
from hypermesh.agent.burst.ec2 import (
    TAG_NAMESPACE,
    TAG_NODE,
    TAG_POOL,
    Ec2Provisioner,
    decode_user_data,
)
from hypermesh.agent.burst.policy import BurstConfig, Launch, Release
from hypermesh.agent.burst.provisioner import (
    CapacityRefused,
    Context,
    NodeSpec,
    ProvisionError,
    launch_with_fallback,
)
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.processes import free_port, stop_process, wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.pools import Pool
from tests.burst.test_burst_events import stand_in_leader
from tests.conftest import Mesh

REGION = "us-east-1"


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited:\n{log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    return True
            except OSError:
                return False

        wait_for(up, 60, "the moto server")
        yield url
    finally:
        stop_process(proc, 10)


@pytest.fixture
def ec2(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", REGION)):
        monkeypatch.setenv(key, value)
    return boto3.client("ec2", region_name=REGION, endpoint_url=moto_endpoint)


_IMAGES: dict[str, str] = {}


def image_id(ec2: Any) -> str:
    """One of moto's AMIs (listing them is slow: once per server)."""
    endpoint = ec2.meta.endpoint_url
    if endpoint not in _IMAGES:
        images = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"]
        _IMAGES[endpoint] = str(images[0]["ImageId"])
    return _IMAGES[endpoint]


def provisioner(ec2: Any, moto_endpoint: str, namespace: str = "ns1",
                **options: str) -> Ec2Provisioner:
    pool = Pool("cloud", kind="ec2", price=1.0, spot_price=0.3, spot=True, max_nodes=4,
                slots=2, gpus=1, gpu_type="t4",
                options={"image_id": image_id(ec2), "instance_type": "t3.large",
                         "region": REGION, "endpoint": moto_endpoint,
                         "etcd": "http://10.0.0.5:2379", **options})
    ctx = Context(etcd="http://127.0.0.1:2379", namespace=namespace, work_root=Path("/tmp"))
    return Ec2Provisioner(pool, ctx, client=ec2)


def describe(ec2: Any, instance_id: str) -> dict[str, Any]:
    return dict(ec2.describe_instances(InstanceIds=[instance_id])
                ["Reservations"][0]["Instances"][0])


def tags(instance: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance.get("Tags", [])}


def test_spot_launch_request_tags_and_user_data(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint)
    spec = NodeSpec("cloud-a1", prov.pool, spot=True)
    request = prov.request(spec)
    assert request["InstanceMarketOptions"] == {
        "MarketType": "spot",
        "SpotOptions": {"SpotInstanceType": "one-time",
                        "InstanceInterruptionBehavior": "terminate"},
    }
    instance_id = prov.launch(spec)
    instance = describe(ec2, instance_id)
    assert instance["InstanceType"] == "t3.large"
    assert instance.get("InstanceLifecycle") == "spot"
    assert tags(instance) == {TAG_NAMESPACE: "ns1", TAG_POOL: "cloud", TAG_NODE: "cloud-a1",
                              "Name": "cloud-a1"}
    attr = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    script = decode_user_data(attr["UserData"]["Value"])
    assert script.startswith("#!/bin/bash\n")
    assert ("exec hypermesh agent start --etcd http://10.0.0.5:2379 --namespace ns1 "
            "--name cloud-a1 --slots 2 --work-dir /var/lib/hypermesh --pool cloud --spot "
            "--gpus 1 --gpu-type t4 --listen") in script


def test_on_demand_launch_has_no_market_options(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint)
    request = prov.request(NodeSpec("cloud-b1", prov.pool, spot=False))
    assert "InstanceMarketOptions" not in request
    instance = describe(ec2, prov.launch(NodeSpec("cloud-b1", prov.pool, spot=False)))
    assert "InstanceLifecycle" not in instance


def test_launch_template_request() -> None:
    pool = Pool("cloud", kind="ec2", max_nodes=1,
                options={"launch_template": "lt-0abc", "subnet_id": "subnet-1",
                         "security_group_ids": "sg-1,sg-2"})
    prov = Ec2Provisioner(pool, Context("http://e:2379", "ns", Path("/tmp")), client=object())
    request = prov.request(NodeSpec("n", pool, spot=False))
    assert request["LaunchTemplate"] == {"LaunchTemplateId": "lt-0abc", "Version": "$Default"}
    assert "ImageId" not in request
    assert request["SubnetId"] == "subnet-1" and request["SecurityGroupIds"] == ["sg-1", "sg-2"]


def test_launch_from_a_launch_template(ec2: Any, moto_endpoint: str) -> None:
    """A template named by name (not lt-...) really launches on the server: the image and
    type come from the template, tags and user data from the provisioner, and a spot
    node is spot."""
    name = "hm-test-template"
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={
        "ImageId": image_id(ec2), "InstanceType": "t3.small"})
    pool = Pool("cloud", kind="ec2", price=1.0, spot_price=0.3, spot=True, max_nodes=1,
                options={"launch_template": name, "region": REGION, "endpoint": moto_endpoint})
    prov = Ec2Provisioner(pool, Context("http://127.0.0.1:2379", "ns1", Path("/tmp")),
                          client=ec2)
    spec = NodeSpec("cloud-t1", prov.pool, spot=True)
    request = prov.request(spec)
    assert request["LaunchTemplate"] == {"LaunchTemplateName": name, "Version": "$Default"}
    assert "ImageId" not in request and "InstanceType" not in request
    instance = describe(ec2, prov.launch(spec))
    assert instance["ImageId"] == image_id(ec2)
    assert instance["InstanceType"] == "t3.small"
    assert instance.get("InstanceLifecycle") == "spot"
    assert tags(instance)[TAG_NODE] == "cloud-t1"
    attr = ec2.describe_instance_attribute(InstanceId=instance["InstanceId"],
                                           Attribute="userData")
    assert "--name cloud-t1" in decode_user_data(attr["UserData"]["Value"])


def test_values_in_user_data_are_quoted(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint, namespace="ns1")
    pool = Pool("cloud", kind="ec2", max_nodes=1, gpu_type="a100; rm -rf /",
                options={"image_id": "ami-1"})
    script = prov.request(NodeSpec("n1", pool, spot=False))["UserData"]
    assert "--gpu-type 'a100; rm -rf /'" in script


def test_scale_down_terminates_only_owned_instances(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint, namespace="ns-own")
    ours = prov.launch(NodeSpec("cloud-c1", prov.pool, spot=False))
    # Someone else's instance, and one of another mesh with the same node name.
    foreign = ec2.run_instances(ImageId=image_id(ec2), MinCount=1, MaxCount=1)
    foreign_id = foreign["Instances"][0]["InstanceId"]
    other_mesh = provisioner(ec2, moto_endpoint, namespace="ns-other").launch(
        NodeSpec("cloud-c1", prov.pool, spot=False))

    assert prov.terminate("cloud-c1", foreign_id) is False
    assert prov.terminate("cloud-c1", other_mesh) is False
    assert prov.terminate("cloud-c2", ours) is False  # ours, but not that node
    assert describe(ec2, foreign_id)["State"]["Name"] == "running"
    assert describe(ec2, other_mesh)["State"]["Name"] == "running"
    assert prov.gone("cloud-c1", ours) is False

    assert prov.terminate("cloud-c1", ours) is True
    assert describe(ec2, ours)["State"]["Name"] in ("shutting-down", "terminated")
    assert prov.gone("cloud-c1", ours) is True
    assert prov.terminate("cloud-c1", ours) is True  # already gone: stopped


def test_a_lost_provider_id_is_found_by_tags(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint, namespace="ns-lost")
    other = provisioner(ec2, moto_endpoint, namespace="ns-lost2").launch(
        NodeSpec("cloud-f1", prov.pool, spot=False))
    ours = prov.launch(NodeSpec("cloud-f1", prov.pool, spot=False))
    assert prov.find("cloud-f1") == ours
    assert prov.terminate("cloud-f1", "") is True
    assert describe(ec2, ours)["State"]["Name"] in ("shutting-down", "terminated")
    assert describe(ec2, other)["State"]["Name"] == "running"
    assert prov.find("cloud-f1") == "" and prov.terminate("cloud-f1", "") is True


def refuse_spot(ec2: Any, code: str = "InsufficientInstanceCapacity") -> list[dict[str, Any]]:
    """Make the client refuse spot RunInstances with ``code``; returns the requests seen."""
    seen: list[dict[str, Any]] = []

    def hook(params: dict[str, Any], **_: Any) -> None:
        seen.append(params)
        if "InstanceMarketOptions" in params:
            raise ClientError({"Error": {"Code": code, "Message": "no spot capacity"}},
                              "RunInstances")

    ec2.meta.events.register("provide-client-params.ec2.RunInstances", hook)
    return seen


def test_capacity_error_falls_back_to_on_demand(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint)
    seen = refuse_spot(ec2)
    with pytest.raises(CapacityRefused) as info:
        prov.launch(NodeSpec("cloud-d1", prov.pool, spot=True))
    assert info.value.spot is True
    started = launch_with_fallback(prov, NodeSpec("cloud-d2", prov.pool, spot=True))
    assert started.spot is False
    assert started.refused == "spot capacity refused: InsufficientInstanceCapacity"
    assert ["InstanceMarketOptions" in p for p in seen] == [True, True, False]
    instance = describe(ec2, started.provider_id)
    assert "InstanceLifecycle" not in instance
    assert tags(instance)[TAG_NODE] == "cloud-d2"


def test_other_errors_are_not_capacity(ec2: Any, moto_endpoint: str) -> None:
    prov = provisioner(ec2, moto_endpoint)
    refuse_spot(ec2, code="UnauthorizedOperation")
    with pytest.raises(ProvisionError, match="UnauthorizedOperation"):
        launch_with_fallback(prov, NodeSpec("cloud-e1", prov.pool, spot=True))


def test_leader_duty_falls_back_records_and_releases(ec2: Any, moto_endpoint: str,
                                                     mesh: Mesh) -> None:
    """The burst duty with this provisioner and a real etcd: a refused spot launch
    starts on-demand, the record and the events say so, and the release terminates it."""
    prov = provisioner(ec2, moto_endpoint, namespace=mesh.namespace)
    refuse_spot(ec2)

    async def scenario() -> tuple[dict[str, Any], list[str], str]:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            leader = await stand_in_leader(mesh, etcd)

            async def reload() -> None:
                leader.view.reset()
                kvs, _ = await etcd.get_prefix(leader.ks.root)
                for kv in kvs:
                    leader.view.apply(kv.key.decode(), kv.value, kv.create_revision,
                                      kv.mod_revision)

            duty = BurstDuty(leader, BurstConfig.local())  # type: ignore[arg-type]
            duty._provisioners["cloud"] = (prov.pool, prov)
            await duty._take_over()
            await duty._launch(Launch("cloud", 1, True, "backlog: test"), prov.pool, 100.0)
            await reload()
            ((name, record),) = leader.view.instances.items()
            assert duty._history(101.0)["cloud"].refused_s_ago == 1.0
            await duty._release(Release(name, "cloud", "idle for 9s"), prov.pool)
            await reload()
            after = leader.view.instances[name]["state"]
            kvs, _ = await etcd.get_prefix(leader.ks.kind_prefix("event"))
            return record, [json.loads(kv.value)["action"] for kv in kvs], after

    record, actions, state_after = asyncio.run(scenario())
    assert record["spot"] is False and record["state"] == "starting"
    assert record["provider_id"].startswith("i-")
    assert actions == ["launch", "refused", "release"]
    assert state_after == "releasing"
    assert describe(ec2, record["provider_id"])["State"]["Name"] in ("shutting-down",
                                                                    "terminated")
