"""A small TCP proxy that degrades a link on purpose: latency, a bandwidth cap, resets and
black-holing. It runs its own asyncio loop in a thread, so a test or a benchmark drives it
with plain calls while gRPC channels connect through it (`127.0.0.1:proxy.port`).

- `latency_s`: each piece of data waits this long before it is forwarded (each direction).
- `gbps`: each direction's rate is capped (Gbit/s; 0: uncapped).
- `blackhole()`: data stops flowing both ways and new connections are accepted but not
  served, like a partition: nothing is refused, nothing arrives (TCP's own buffers fill).
  `heal()` lets it flow again.
- `reset()`: every open connection is aborted with a TCP RST (SO_LINGER 0); new ones work.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

PIECE = 64 << 10


class NetProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int = 0):
        self.target = (target_host, target_port)
        self.latency_s, self.gbps = 0.0, 0.0
        self.connections = 0  # accepted so far
        self._want_port = port
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netproxy", daemon=True)
        self._thread.start()
        self._flowing = self._call(self._make_event)
        self._server = self._call(self._serve)
        self.port = self._server.sockets[0].getsockname()[1]

    # ---- control, from any thread ----------------------------------------------------
    def _call(self, fn, *args):
        async def run():
            return await fn(*args) if asyncio.iscoroutinefunction(fn) else fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    @staticmethod
    def _make_event() -> asyncio.Event:
        e = asyncio.Event()
        e.set()
        return e

    def blackhole(self) -> None:
        self._call(self._flowing.clear)

    def heal(self) -> None:
        self._call(self._flowing.set)

    def reset(self) -> int:
        """Abort every open connection with an RST; how many there were."""
        def abort():
            n = 0
            for w in list(self._writers):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:
                        pass
                w.transport.abort()
                n += 1
            self._writers.clear()
            return n
        return self._call(abort)

    def close(self) -> None:
        self.reset()
        self._call(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # ---- the proxy itself, on its loop ---------------------------------------------
    async def _serve(self):
        return await asyncio.start_server(self._accept, "127.0.0.1", self._want_port)

    async def _accept(self, reader, writer):
        self.connections += 1
        self._writers.add(writer)
        try:
            await self._flowing.wait()
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._drop(writer)
            return
        self._writers.add(up_writer)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)
        self._drop(writer)
        self._drop(up_writer)

    async def _pump(self, reader, writer):
        try:
            while True:
                data = await reader.read(PIECE)
                if not data:
                    break
                await self._flowing.wait()
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                if self.gbps:
                    await asyncio.sleep(len(data) * 8 / (self.gbps * 1e9))
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            self._drop(writer)

    def _drop(self, writer):
        self._writers.discard(writer)
        if not writer.is_closing():
            writer.close()
