"""A TCP proxy that holds each piece the server sends for DELAY seconds: a store's round trip on loopback.

    python benchmarks/lagproxy.py 29999 8333 0.02 &     # listen on 29999, forward to the S3 server on 8333
    AWS_ENDPOINT_URL=http://127.0.0.1:29999 tokpipe verify s3://BUCKET/PREFIX

A small object's answer is one piece, so each request waits DELAY more (a region's S3 answers a small GET or a HEAD
in ~10-30 ms); a large body, read 64 KiB a piece, waits DELAY a piece: this measures latency, not bandwidth.
"""

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    try:
        while data := await reader.read(1 << 16):
            await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(listen: int, target: int, delay: float) -> None:
    async def connected(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(_pipe(client_reader, server_writer, 0), _pipe(server_reader, client_writer, delay))

    async with await asyncio.start_server(connected, "127.0.0.1", listen) as server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
