"""Ids that arrive from outside are checked before they name a file: a real agent
refuses task ids and chunk ids that would reach outside its work directory or its
chunk cache, and says which id it refused."""

from __future__ import annotations

import json

import grpc
import pytest

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.tasks.containers import container_argv
from hypermesh.errors import RecipeError
from hypermesh.recipe.recipe import parse_recipe
from tests.conftest import Mesh

TRAVERSALS = ["../../../../etc/passwd", "w/../../x.e.1", "..", "w.e.1\n"]


def call_code(address: str, request: object, method: str) -> tuple[str, str]:
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentStub(channel)
        try:
            for _ in getattr(stub, method)(request, timeout=10):
                pass
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", ""


@pytest.mark.parametrize("bad", TRAVERSALS)
def test_an_agent_refuses_ids_that_name_paths(mesh: Mesh, bad: str) -> None:
    agent = mesh.agent("node1")
    (mesh.root / "secret.txt").write_text("not for peers")  # beside the work directory
    code, details = call_code(
        agent.address, agent_pb2.ReadLogsRequest(task_id=bad), "ReadLogs"
    )
    assert code == "INVALID_ARGUMENT" and "not a task id" in details
    code, details = call_code(
        agent.address, agent_pb2.ReadChunkRequest(chunk=bad, offset=0, length=10), "ReadChunk"
    )
    assert code == "INVALID_ARGUMENT" and "not a chunk id" in details
    code, details = call_code(
        agent.address, agent_pb2.ReadChunkRequest(chunk=bad, offset=0, length=10),
        "FetchFromPeers",
    )
    assert code == "INVALID_ARGUMENT" and "need a chunk id" in details


@pytest.mark.parametrize("image", ["--privileged", "-v/:/host", "img;rm -rf /", "a b", "x:"])
def test_an_image_that_is_not_an_image_reference_is_refused(image: str) -> None:
    text = f"experiments:\n  e:\n    image: {json.dumps(image)}\n    command: ['true']\n"
    with pytest.raises(RecipeError) as caught:
        parse_recipe(text, "r.yaml")
    problems = [str(p) for p in caught.value.problems]
    assert any(p.startswith("r.yaml:3: experiments.e.image: ") and "not an image reference" in p
               for p in problems), problems
    with pytest.raises(ValueError, match="not an image reference"):
        container_argv("podman", image, "true", name="t", env=[], workdir="/w")
    ok = parse_recipe(text.replace(json.dumps(image), "pytorch/pytorch:2.4.1"), "r.yaml")
    assert ok.experiment("e").image == "pytorch/pytorch:2.4.1"
