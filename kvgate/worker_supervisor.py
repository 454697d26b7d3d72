"""`kvgate serve --workers N`: uvicorn's worker supervisor, with one change to its drain.

The supervisor binds the listening socket and every worker inherits a copy. On SIGTERM (or
SIGINT) each worker closes its copy at once and finishes what it has in flight, but uvicorn's
supervisor keeps its own copy open until the last worker has exited. While any copy is open the
kernel completes new connections into the listen backlog, where no process will ever accept
them: a client or load balancer that connected during the drain waited up to
`server.drain_seconds` and was then reset, where one process refuses it at once. This
supervisor closes its copy as soon as it is told to stop, so a draining gateway refuses new
connections whether it runs one process or several.
"""

from __future__ import annotations

from uvicorn import Config
from uvicorn.supervisors import Multiprocess


class ListenerClosingSupervisor(Multiprocess):
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
