"""The object store on a real S3 endpoint (moto's HTTP server on loopback) and on ``file://``.

Tiering through the S3 store is checked too: segment objects land in the bucket with the
size and MD5 etag that their etcd descriptors state. moto's server runs in a thread of the test
process, so the store tests are unit tests; tiering needs etcd and a broker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess, free_port
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

BUCKET = "danube-test"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="test", aws_secret_access_key="test",
    ).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def _s3_store(endpoint: str, prefix: str) -> ObjectStore:
    return ObjectStore(
        f"s3://{BUCKET}/{prefix}",
        storage_options={"endpoint_url": endpoint, "key": "test", "secret": "test", "client_kwargs": {"region_name": "us-east-1"}},
    )


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["s3", "file"])
def test_put_get_info(backend: str, s3_endpoint: str, tmp_path: Path) -> None:
    store = _s3_store(s3_endpoint, "roundtrip") if backend == "s3" else ObjectStore(tmp_path.as_uri())
    data = b"dnb1 segment bytes " * 1000
    info = store.put_bytes("topics/default/t/data-0-9.dnb1", data)
    assert info.size_bytes == len(data)
    assert info.etag == hashlib.md5(data).hexdigest()
    assert store.get_bytes("topics/default/t/data-0-9.dnb1") == data
    assert store.exists("topics/default/t/data-0-9.dnb1")
    assert not store.exists("topics/default/t/data-10-19.dnb1")
    assert store.info("topics/default/t/data-10-19.dnb1") is None
    got = store.info("topics/default/t/data-0-9.dnb1", compute_etag=True)
    assert got is not None and (got.size_bytes, got.etag) == (len(data), info.etag)
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"x")
    assert store.list("topics/default") == ["topics/default/t/data-0-9.dnb1"]
    store.delete("topics/default/t/data-0-9.dnb1")
    assert store.info("topics/default/t/data-0-9.dnb1") is None
    assert store.list("topics/default") == []


@pytest.mark.unit
def test_put_under_a_regular_file_fails(tmp_path: Path) -> None:
    """A root that lies under a regular file cannot be written: the failure the asset retry
    test in test_assets.py relies on."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = ObjectStore((blocker / "objects").as_uri())
    with pytest.raises(NotADirectoryError):
        store.put_bytes("topics/default/t/data-0-9.dnb1", b"x")
    blocker.unlink()
    assert store.put_bytes("topics/default/t/data-0-9.dnb1", b"x").size_bytes == 1


@pytest.mark.integration
@pytest.mark.asyncio
async def test_tiering_to_s3(
    s3_endpoint: str, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker(segment_max_bytes=16 * 1024)
    topic = TopicName.parse("/default/s3tiered")
    async with DanubeClient([broker.address]) as client:
        async with client.producer(topic.path, producer_name="s3", max_batch_messages=50) as producer:
            for i in range(600):
                producer.send_nowait(f"message {i}".encode() * 4)
            await producer.flush()
        await client.admin.seal_active_segment(topic.path)
        sealed = await client.admin.list_sealed_segments(topic.path)
        store = _s3_store(s3_endpoint, "tiering")
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=store)
            kvs, _ = await meta.get_prefix(keys.objects_prefix(topic))
    descriptors = [ObjectDescriptor.from_json(kv.value) for kv in kvs if not kv.key.endswith("/cur")]
    assert len(sealed) >= 2
    assert [(d.start_offset, d.end_offset) for d in descriptors] == [(s.start_offset, s.end_offset) for s in sealed]
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")
    for d in descriptors:
        assert d.completed
        head = s3.head_object(Bucket=BUCKET, Key=f"tiering/topics/default/s3tiered/{d.object_id}")
        assert head["ContentLength"] == d.size
        assert head["ETag"].strip('"') == d.etag
