"""`/metrics` of a Ray Serve deployment, aggregated across replicas.

Every replica keeps its own `ServerMetrics` (the single-process server's, unchanged). A `ClusterMetrics` replica
exchanges its exposition with one `MetricsBoard` actor per Serve application every `period_s` seconds: it posts its
own text and gets back the latest text of every other live replica. Its `render()` (what `GET /metrics` answers)
merges its own current figures with the others' last posts (`metrics_merge.merge_expositions`), each sample
labelled `replica="<Serve replica id>"`. So one scrape of `/metrics` through any proxy returns every live replica:

- its own figures are current, the other replicas' are at most `period_s` (+ one exchange) old;
- a replica that stopped posting (killed, or scaled down) drops out after 5 periods; a replacement appears under its
  own id with counters from zero (a new series, as Prometheus expects of a restarted process);
- sum over the `replica` label for deployment-wide figures, e.g. `sum without (replica) (rate(...))`.

The board is a named, detached actor (`board_name(app)`, namespace `NAMESPACE`), created by the first replica that
asks and shared by the others; `dicache serve --ray` removes it on exit.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST

from ..metrics import ServerMetrics
from ..metrics_merge import merge_expositions

log = logging.getLogger("dicache.server.ray")

NAMESPACE = "dicache"
DEFAULT_PERIOD_S = 2.0
EXCHANGE_TIMEOUT_S = 10.0


def board_name(app_name: str) -> str:
    return f"dicache-metrics-{app_name}"


class MetricsBoard:
    """The latest exposition posted by each replica (run as a Ray actor; plain Python, testable without Ray).

    `clock` gives seconds (monotonic); a post older than `ttl_s` is forgotten.
    """

    def __init__(self, ttl_s: float, clock=time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"MetricsBoard: ttl_s={ttl_s!r} must be > 0")
        self.ttl_s, self._clock = ttl_s, clock
        self._posts: dict[str, tuple[float, bytes]] = {}

    def exchange(self, replica: str, text: bytes) -> dict[str, bytes]:
        """Store `replica`'s `text`; return the live posts of the other replicas."""
        now = self._clock()
        self._posts[replica] = (now, text)
        self._posts = {r: post for r, post in self._posts.items() if now - post[0] <= self.ttl_s}
        return {r: text for r, (_, text) in self._posts.items() if r != replica}

    def leave(self, replica: str) -> None:
        self._posts.pop(replica, None)

    def replicas(self) -> list[str]:
        now = self._clock()
        return sorted(r for r, (t, _) in self._posts.items() if now - t <= self.ttl_s)


class ClusterMetrics(ServerMetrics):
    """A replica's `ServerMetrics` whose `render()` covers every replica of the application (see the module doc).

    Call `start()` in the replica (it needs Ray) and `stop()` when it shuts down.
    """

    def __init__(self, replica: str, app_name: str, period_s: float = DEFAULT_PERIOD_S) -> None:
        super().__init__()
        if not period_s > 0:
            raise ValueError(f"ClusterMetrics: period_s={period_s!r} must be > 0")
        self.replica, self.app_name, self.period_s = replica, app_name, period_s
        self.ttl_s = 5 * period_s
        self._others: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._board = None

    def own_text(self) -> bytes:
        return super().render()[0]

    def render(self) -> tuple[bytes, str]:
        texts = {self.replica: self.own_text()}
        texts.update((r, t) for r, t in dict(self._others).items() if r != self.replica)
        try:
            return merge_expositions(texts), CONTENT_TYPE_LATEST
        except ValueError:  # a replica running other code posted something that does not merge: show our own
            log.exception("metrics of other replicas could not be merged; answering this replica's only")
            return merge_expositions({self.replica: texts[self.replica]}), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ exchange with the board (needs Ray)
    def _get_board(self):
        import ray  # the ray extra: `MetricsBoard` and `render` are plain Python

        if self._board is None:
            actor = ray.remote(num_cpus=0, max_restarts=-1)(MetricsBoard)
            self._board = actor.options(
                name=board_name(self.app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
            ).remote(self.ttl_s)
        return self._board

    def sync(self) -> None:
        """Post this replica's figures and fetch the others' (one round trip to the board)."""
        import ray  # the ray extra: `MetricsBoard` and `render` are plain Python

        try:
            others = ray.get(
                self._get_board().exchange.remote(self.replica, self.own_text()), timeout=EXCHANGE_TIMEOUT_S
            )
        except Exception as exc:  # board restarting or unreachable: keep the last view, look it up again next time
            log.warning("metrics exchange failed (%s: %s); retrying in %g s", type(exc).__name__, exc, self.period_s)
            self._board = None
            return
        self._others = others

    def _loop(self) -> None:
        while True:
            self.sync()
            if self._stop.wait(self.period_s):
                return

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dicache-metrics-exchange", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        import ray  # the ray extra: `MetricsBoard` and `render` are plain Python

        self._stop.set()
        if self._thread is not None:
            self._thread.join(EXCHANGE_TIMEOUT_S)
        try:
            if self._board is not None:
                ray.get(self._board.leave.remote(self.replica), timeout=5)
        except Exception:  # the board or the cluster is going away too
            pass
