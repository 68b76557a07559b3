import asyncio
import io
import json
import os

import fastavro

from danube_pipeline.client import AvroSchema, DanubeClient, InitialPosition

SCHEMA = {
    "type": "record",
    "name": "Reading",
    "fields": [{"name": "sensor", "type": "string"}, {"name": "celsius", "type": "double"}],
}
PARSED = fastavro.parse_schema(SCHEMA)


def encode(reading: dict) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, PARSED, reading)
    return buf.getvalue()


async def main() -> None:
    bootstrap = os.environ.get("DANUBE_BROKER_ADDRESSES", "127.0.0.1:6650")
    async with DanubeClient(bootstrap) as client:
        await client.admin.create_topic("/default/readings")
        schema = AvroSchema(subject="readings", raw_schema=json.dumps(SCHEMA))
        async with client.producer("/default/readings", producer_name="quickstart", schema=schema) as producer:
            for celsius in (21.5, 22.0, 22.5):
                offset = await producer.send(encode({"sensor": "s1", "celsius": celsius}))
                print("sent", celsius, "at offset", offset)
        async with client.consumer(
            "/default/readings", subscription="quickstart", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            for _ in range(3):
                message = await consumer.receive(timeout_ms=10_000)
                reading = fastavro.schemaless_reader(io.BytesIO(message.payload), PARSED, PARSED)
                print("received", reading, "at offset", message.offset)
                await consumer.ack(message)


asyncio.run(main())
