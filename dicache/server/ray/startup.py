"""Starting `dicache serve` on Ray Serve within the declared timeouts (`RayServeOptions`), or failing in one line.

- The environment: Serve's controller times its HTTP proxy by two variables it reads once, when it starts
  (`proxy_environment`); a local cluster started for dicache also gets Serve's errors in the OpenAI shape (`proxy`)
  and Ray's workers at the starting process's priority (`local_cluster_environment`).
- The driver's waits: `start_serve` starts Serve and waits until its controller reports the HTTP proxy healthy
  (`--proxy-start-timeout`), `deploy` runs the application and waits for its replicas (`--replica-start-timeout`).
  A start-up that fails is a `StartupError`: one line saying what did not start and which option to raise.
"""

from __future__ import annotations

import importlib
import signal
import time
from typing import Any

from ...errors import StartupError
from .deployment import APP_NAME, DEPLOYMENT_NAME
from .options import RayServeOptions
from .proxy import CALLBACK_ENV, CALLBACK_PATH

PROXY_CHECKS = 3
"""Failed readiness or health checks in a row after which Serve's controller gives up on its HTTP proxy and
restarts it (Ray 2.60: `PROXY_HEALTH_CHECK_UNHEALTHY_THRESHOLD`, not configurable)."""
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_HEALTH_ENV = "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"
WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray's setting for how much its worker processes (Serve's controller and proxy, the replicas) lower their own
priority: 15 by default, under which any other busy process on the node takes nearly all the CPU from them."""

PROXY_WAIT_MARGIN_S = 10.0
"""Seconds the driver waits for Serve's HTTP proxy beyond --proxy-start-timeout, so that Serve's controller, which
gives up on the proxy after that long, gives the verdict."""


def proxy_environment(options: RayServeOptions) -> dict[str, str]:
    """The environment variables through which Serve's controller times its HTTP proxy (read once, when the
    controller process imports Ray Serve): each of the `PROXY_CHECKS` readiness checks in a row gets
    `proxy_start_timeout_s / PROXY_CHECKS` seconds, each health check `proxy_health_timeout_s`."""
    return {
        PROXY_READY_ENV: repr(options.proxy_start_timeout_s / PROXY_CHECKS),
        PROXY_HEALTH_ENV: repr(options.proxy_health_timeout_s),
    }


def local_cluster_environment(options: RayServeOptions) -> dict[str, str]:
    """The environment a local Ray cluster started for dicache must inherit from the process that starts it: Serve's
    errors in the OpenAI shape (`proxy`), the proxy's timeouts (`proxy_environment`), and Ray's workers at that
    process's own priority (not 15 lower), so that a busy node shares its CPU with them fairly."""
    return {CALLBACK_ENV: CALLBACK_PATH, WORKER_NICENESS_ENV: "0", **proxy_environment(options)}


class _StartTimedOut(BaseException):
    """--replica-start-timeout ran out while the application was being deployed (SIGALRM; a BaseException, as the
    driver's `_StoppedStarting`, so that Ray's code lets it through)."""


def wait_for_proxy_up_to(seconds: float) -> None:
    """Let `serve.start` / `serve.run` in this process wait `seconds` for Serve's HTTP proxy: Ray 2.60 waits a fixed
    `HTTP_PROXY_TIMEOUT` (60 s, read at call time from these modules), which would cut a longer
    --proxy-start-timeout short. A Ray without the constant is left as it is."""
    for name in ("ray.serve._private.api", "ray.serve._private.client"):
        module = importlib.import_module(name)
        if isinstance(getattr(module, "HTTP_PROXY_TIMEOUT", None), (int, float)):
            module.HTTP_PROXY_TIMEOUT = seconds


def wait_for_proxies(serve: Any, seconds: float, poll_s: float = 0.25) -> None:
    """Wait until Serve's controller reports every HTTP proxy it has started HEALTHY; TimeoutError after `seconds`.

    The controller is the judge: `serve.start` returns once a proxy answered the driver, even when the controller has
    already given up on that proxy for missing its readiness checks (and starts another one).
    """
    deadline = time.monotonic() + seconds
    nodes = None
    while True:
        proxies = {node: getattr(status, "value", status) for node, status in serve.status().proxies.items()}
        nodes = set(proxies) if nodes is None else nodes  # the proxies of this start; others come with replicas
        waiting = sorted({proxies.get(node, "gone") for node in nodes} - {"HEALTHY"})
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {seconds:g} s a proxy is {' / '.join(waiting)}")
        time.sleep(poll_s)


def summary(exc: BaseException, limit: int = 300) -> str:
    """One line for a (Ray) error whose text may span lines (a remote traceback): its first and last lines."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def proxy_start_error(exc: BaseException, options: RayServeOptions) -> StartupError:
    """The one-line error for a Serve whose HTTP proxy did not start (`serve.start` raised `exc`)."""
    cause = getattr(exc, "cause", None)  # a RayTaskError: the proxy itself failed, e.g. its port is taken
    if cause is not None:
        return StartupError(f"Ray Serve's HTTP proxy failed to start: {summary(cause)}")
    return StartupError(
        f"Ray Serve's HTTP proxy did not start within --proxy-start-timeout={options.proxy_start_timeout_s:g} s "
        f"({summary(exc)}); on a busy machine, raise --proxy-start-timeout"
    )


def start_serve(serve: Any, options: RayServeOptions, http_options: dict[str, Any]) -> None:
    """Start Serve with `options`' proxy timeouts (`proxy_environment`) and wait until its controller
    reports the HTTP proxy healthy; a proxy that does not start is a StartupError naming --proxy-start-timeout."""
    wait_s = options.proxy_start_timeout_s + PROXY_WAIT_MARGIN_S
    wait_for_proxy_up_to(wait_s)
    try:
        serve.start(
            http_options=http_options,
            # Serve's controller times its proxy by these (taken when Serve first starts on the cluster)
            controller_options={"runtime_env": {"env_vars": proxy_environment(options)}},
        )
        wait_for_proxies(serve, wait_s)
    except Exception as exc:
        raise proxy_start_error(exc, options) from None


def deploy(serve: Any, application: Any, options: RayServeOptions) -> None:
    """`serve.run(application)`, which returns once every replica runs, within --replica-start-timeout (SIGALRM: call
    from the main thread; a real-time timer armed before, e.g. a test runner's, is re-armed after with the time it had
    left). A replica that fails or does not start in time is a StartupError naming the option."""

    def on_alarm(*_: Any) -> None:
        raise _StartTimedOut

    previous = signal.signal(signal.SIGALRM, on_alarm)
    armed = time.monotonic()
    pending, interval = signal.setitimer(signal.ITIMER_REAL, options.replica_start_timeout_s)
    try:
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
    except _StartTimedOut:
        raise StartupError(
            f"Ray Serve's replicas did not start within --replica-start-timeout={options.replica_start_timeout_s:g} "
            f"s ({replica_states(serve)}); on a slow or busy machine, raise --replica-start-timeout"
        ) from None
    except TimeoutError as exc:  # Serve's wait for its proxies to serve the application
        raise proxy_start_error(exc, options) from None
    except Exception as exc:  # a replica failed to start (Serve gave up retrying it)
        raise StartupError(f"Ray Serve could not start the replicas: {summary(exc)}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - armed), 0.001), interval)


def replica_states(serve: Any) -> str:
    """The deployment's replicas by state, from Serve's status: 'replicas: 1 RUNNING, 1 STARTING'."""
    try:
        states = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
    except Exception:  # no application or deployment yet, or Serve cannot answer
        return "replicas: state unknown"
    return "replicas: " + (
        ", ".join(f"{n} {getattr(state, 'value', state)}" for state, n in sorted(states.items())) or "none"
    )
