"""`kvgate serve --workers N`: uvicorn's worker supervisor, with two changes: its drain and its
reload.

The supervisor binds the listening socket and every worker inherits a copy. On SIGTERM (or
SIGINT) each worker closes its copy at once and finishes what it has in flight, but uvicorn's
supervisor keeps its own copy open until the last worker has exited. While any copy is open the
kernel completes new connections into the listen backlog, where no process will ever accept
them: a client or load balancer that connected during the drain waited up to
`server.drain_seconds` and was then reset, where one process refuses it at once. This
supervisor closes its copy as soon as it is told to stop, so a draining gateway refuses new
connections whether it runs one process or several.

On SIGHUP uvicorn's supervisor replaces every worker in turn, and each retiring worker closes its
idle keep-alive connections: a client that was just reusing one (an aiohttp or httpx client
between two requests) met a reset, and streams longer than the drain were cut. Here SIGHUP is
passed on to every worker instead, and each reloads the config in place as a single process
does (kvgate/hot_reload.py): connections, streams, breakers and drained flags go on, and a
worker that cannot load the new config keeps serving the old one (and logs why).

A worker that stops on its own takes its live gauges out of the summed metrics as it goes
(`Metrics.process_exited`). One that dies (killed, out of memory) cannot: the supervisor does
it for that worker when it replaces it, or its last queue length would stay in every scrape.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from uvicorn import Config
from uvicorn.supervisors import Multiprocess

from kvgate.observability.metrics import forget_dead_process

log = logging.getLogger("kvgate")


class ListenerClosingSupervisor(Multiprocess):
    def keep_subprocess_alive(self) -> None:
        before = {process.pid for process in self.processes}
        super().keep_subprocess_alive()
        for pid in before - {process.pid for process in self.processes}:
            if pid is not None:
                forget_dead_process(pid)

    def handle_hup(self) -> None:
        log.info("SIGHUP: every worker reloads the config in place")
        for process in self.processes:
            if process.pid is not None:
                # A worker not serving yet dies of it and is replaced by one that loads the
                # new config, as a worker that dies for any reason is.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)

    def handle_term(self) -> None:
        self._stop_listening()
        super().handle_term()

    def handle_int(self) -> None:
        self._stop_listening()
        super().handle_int()

    def _stop_listening(self) -> None:
        for sock in self.sockets:
            sock.close()


def serve_workers(config: Config) -> None:
    """Run `config.workers` worker processes of `config.app` (an import string) on one socket
    until SIGTERM or SIGINT, as `uvicorn.run` does."""
    sock = config.bind_socket()
    try:
        ListenerClosingSupervisor(config, sockets=[sock]).run()
    finally:
        sock.close()
