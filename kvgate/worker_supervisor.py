"""`kvgate serve --workers N`: uvicorn's worker supervisor, with one change to its drain.

The supervisor binds the listening socket and every worker inherits a copy. On SIGTERM (or
SIGINT) each worker closes its copy at once and finishes what it has in flight, but uvicorn's
supervisor keeps its own copy open until the last worker has exited. While any copy is open the
kernel completes new connections into the listen backlog, where no process will ever accept
them: a client or load balancer that connected during the drain waited up to
`server.drain_seconds` and was then reset, where one process refuses it at once. This
supervisor closes its copy as soon as it is told to stop, so a draining gateway refuses new
connections whether it runs one process or several.

A worker that stops on its own takes its live gauges out of the summed metrics as it goes
(`Metrics.process_exited`). One that dies (killed, out of memory) cannot: the supervisor does
it for that worker when it replaces it, or its last queue length would stay in every scrape.
"""

from __future__ import annotations

from uvicorn import Config
from uvicorn.supervisors import Multiprocess

from kvgate.observability.metrics import forget_dead_process


class ListenerClosingSupervisor(Multiprocess):
    def keep_subprocess_alive(self) -> None:
        before = {process.pid for process in self.processes}
        super().keep_subprocess_alive()
        for pid in before - {process.pid for process in self.processes}:
            if pid is not None:
                forget_dead_process(pid)

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
