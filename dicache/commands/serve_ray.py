"""`dicache serve --ray`: the same server as N Ray Serve replicas behind one endpoint (`dicache.server.ray_serve`).

Without `--ray-address` it starts a local Ray cluster; with one (or RAY_ADDRESS) it deploys onto that cluster. It
then runs until SIGINT / SIGTERM, which drains every replica as the single-process server drains (`ray_drain`: new
requests and `/health` get 503 + Retry-After, accepted generations get `--drain-timeout` seconds, the rest get 503;
a second signal ends the grace period at once, a third stops waiting), then deletes the application. A signal while
the replicas are still starting stops the start-up. Either way it exits 0. A start-up that fails (Serve's HTTP proxy
not up within --proxy-start-timeout, replicas not up within --replica-start-timeout, a replica that cannot load) is
one line saying what failed and which option to raise, with exit status 1 (`StartupError`).
Nothing here imports Ray unless `--ray` is given.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError, DicacheError, StartupError


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Ray Serve (--ray)",
        "serve N replicas of this server behind one endpoint on a Ray cluster (needs `pip install 'dicache[ray]'`); "
        "--tp-size / --ulysses-degree then split each replica's model over that many GPUs (no torchrun)",
    )
    from ..server.ray.deployment import RayServeOptions
    from ..server.ray.options import RayDriverOptions
    from .fields import add_options

    add_options(group, RayDriverOptions)
    add_options(group, RayServeOptions, checked=False)  # the options' own messages name the flag and the bound


DRAIN_MARGIN_S = 3.0
"""Seconds the driver waits for the replicas' drains beyond `--drain-timeout` + their answer timeout."""


PROXY_WAIT_MARGIN_S = 10.0
"""Seconds the driver waits for Serve's HTTP proxy beyond --proxy-start-timeout, so that Serve's controller, which
gives up on the proxy after that long, gives the verdict."""


class _StoppedStarting(BaseException):
    """SIGINT / SIGTERM while the application was being deployed (a BaseException, so that no handler in Ray's code
    path mistakes it for a failure)."""


class _StartTimedOut(BaseException):
    """--replica-start-timeout ran out while the application was being deployed (SIGALRM; a BaseException, as
    `_StoppedStarting`, so that Ray's code lets it through)."""


def wait_for_proxy_up_to(seconds: float) -> None:
    """Let `serve.start` / `serve.run` in this process wait `seconds` for Serve's HTTP proxy: Ray 2.60 waits a fixed
    `HTTP_PROXY_TIMEOUT` (60 s, read at call time from these modules), which would cut a longer
    --proxy-start-timeout short. A Ray without the constant is left as it is."""
    import importlib

    for name in ("ray.serve._private.api", "ray.serve._private.client"):
        module = importlib.import_module(name)
        if isinstance(getattr(module, "HTTP_PROXY_TIMEOUT", None), (int, float)):
            module.HTTP_PROXY_TIMEOUT = seconds


def wait_for_proxies(serve: Any, seconds: float, poll_s: float = 0.25) -> None:
    """Wait until Serve's controller reports every HTTP proxy it has started HEALTHY; TimeoutError after `seconds`.

    The controller is the judge: `serve.start` returns once a proxy answered the driver, even when the controller has
    already given up on that proxy for missing its readiness checks (and starts another one).
    """
    import time

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


def proxy_start_error(exc: BaseException, options: Any) -> StartupError:
    """The one-line error for a Serve whose HTTP proxy did not start (`serve.start` raised `exc`)."""
    cause = getattr(exc, "cause", None)  # a RayTaskError: the proxy itself failed, e.g. its port is taken
    if cause is not None:
        return StartupError(f"Ray Serve's HTTP proxy failed to start: {summary(cause)}")
    return StartupError(
        f"Ray Serve's HTTP proxy did not start within --proxy-start-timeout={options.proxy_start_timeout_s:g} s "
        f"({summary(exc)}); on a busy machine, raise --proxy-start-timeout"
    )


def replica_spec_from_args(args: argparse.Namespace, cache_config: Any) -> Any:
    from ..server.ray.deployment import ReplicaSpec
    from .memory import memory_flags, offload_settings
    from .serve_args import settings_from_args
    from .speed import speed_spec

    if offload_settings(args).any:
        raise ConfigError(
            f"dicache serve --ray: the memory options ({', '.join(memory_flags())}) are not supported on Ray "
            "replicas; run the single-process server for them"
        )
    return ReplicaSpec(
        load_format=args.load_format,
        quantization=speed_spec(args),
        compile=args.compile,
        settings=settings_from_args(args),
        model=args.model,
        variant=args.variant,
        dtype=args.dtype,
        device=args.device,
        default_size=args.default_size,
        cache_config=cache_config,
        torch_threads=args.torch_threads,
        tp_size=args.tp_size,
        ulysses_degree=args.ulysses_degree,
    )


def serve_options_from_args(args: argparse.Namespace, spec: Any, cluster_gpus: float | None = None) -> Any:
    """`RayServeOptions` from the options; `cluster_gpus` (the cluster's GPU count, when known) picks the default
    of --gpus-per-replica."""
    from ..parallel import check_degrees
    from ..server.ray.deployment import RayServeOptions
    from ..server.ray.options import default_gpus
    from .fields import values_from_args

    world = args.tp_size * args.ulysses_degree
    check_degrees(world, args.tp_size, args.ulysses_degree)  # each an integer >= 1
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = default_gpus(spec.device, world, cluster_gpus)
    return RayServeOptions(**{**values_from_args(args, RayServeOptions), "gpus_per_replica": gpus})


def ray_warnings(args: argparse.Namespace, settings: Any) -> list[str]:
    """What `dicache serve --ray` warns about at start: a reachable address without an API key (as the single-process
    server does), and connection options that only the single-process server (uvicorn) applies."""
    from ..server.runner import exposure_warnings
    from ..server.settings import ConnectionLimits
    from .serve_args import limits_from_args

    warnings = exposure_warnings(args.host, settings)
    given, default = limits_from_args(args), ConnectionLimits()
    ignored = [
        ConnectionLimits.model_fields[name].json_schema_extra["flag"]
        for name in ("max_connections", "keep_alive_s", "header_timeout_s")
        if getattr(given, name) != getattr(default, name)
    ]
    if ignored:
        warnings.append(
            f"{', '.join(ignored)}: ignored with --ray (Ray Serve's proxy holds the connections, with its own limits); "
            "the request limits, --max-body-bytes and --body-timeout apply"
        )
    return warnings


def start_serve(serve: Any, options: Any, http_options: dict[str, Any]) -> None:
    """Start Serve with `options`' proxy timeouts (`ray_serve.proxy_environment`) and wait until its controller
    reports the HTTP proxy healthy; a proxy that does not start is a StartupError naming --proxy-start-timeout."""
    from ..server.ray.deployment import proxy_environment

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


def deploy(serve: Any, application: Any, options: Any) -> None:
    """`serve.run(application)`, which returns once every replica runs, within --replica-start-timeout (SIGALRM: call
    from the main thread; a real-time timer armed before, e.g. a test runner's, is re-armed after with the time it had
    left). A replica that fails or does not start in time is a StartupError naming the option."""
    import signal
    import time

    from ..server.ray.deployment import APP_NAME

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
    from ..server.ray.deployment import APP_NAME, DEPLOYMENT_NAME

    try:
        states = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
    except Exception:  # no application or deployment yet, or Serve cannot answer
        return "replicas: state unknown"
    return "replicas: " + (
        ", ".join(f"{n} {getattr(state, 'value', state)}" for state, n in sorted(states.items())) or "none"
    )


def run_ray(args: argparse.Namespace) -> int:
    import contextlib
    import dataclasses
    import logging
    import os
    import signal
    import threading

    try:
        import ray
        from ray import serve

        from ..server.ray import deployment as ray_serve
        from ..server.ray.drain import begin_drain, start_board, wait_drained
        from ..server.ray.drain import board_name as drain_board_name
        from ..server.ray.metrics import NAMESPACE, board_name
    except ModuleNotFoundError as exc:
        raise DicacheError(f"dicache serve --ray needs the ray extra: pip install 'dicache[ray]' ({exc})") from None
    from ..settings.profiles import cache_config as read_cache_config
    from ..settings.profiles import describe_profile

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache_config = read_cache_config(args.profile)
    print(cache_config.describe(), flush=True)
    profile = describe_profile(cache_config)
    if profile:
        print(profile, flush=True)
    spec = replica_spec_from_args(args, cache_config)
    checked = serve_options_from_args(args, spec, cluster_gpus=0)
    ray_serve.deployment_options(spec, checked)  # check before starting
    for warning in ray_warnings(args, spec.settings):
        logging.getLogger("dicache.server").warning(warning)
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port={args.port} is invalid: must be between 1 and 65535")

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address is None:  # a local cluster inherits this environment (proxy errors and timeouts, workers' priority)
        for name, value in {**ray_serve.local_cluster_environment(checked), "RAY_USAGE_STATS_ENABLED": "0"}.items():
            os.environ.setdefault(name, value)
    if address is None:
        context = ray.init(include_dashboard=False, logging_level=logging.WARNING)
    else:
        context = ray.init(address=address, logging_level=logging.WARNING)
    print(f"Ray cluster at {context.address_info.get('gcs_address') or address}", flush=True)
    stop, starting, signals = threading.Event(), [True], [0]

    def on_signal(*_: Any) -> None:
        signals[0] += 1
        stop.set()
        if starting[0]:  # abort the deployment in progress (serve.run waits for every replica to load)
            starting[0] = False
            raise _StoppedStarting

    for sig in (signal.SIGINT, signal.SIGTERM):  # before Serve starts: Ray's own handler would abort the process
        signal.signal(sig, on_signal)
    try:
        try:
            options = serve_options_from_args(args, spec, cluster_gpus=ray.cluster_resources().get("GPU", 0))
            if address is None:  # a local cluster cannot grow: refuse replicas it cannot place, before deploying
                ray_serve.check_fits(spec, options, ray.cluster_resources(), "the local Ray cluster")
            start_serve(
                serve,
                options,
                http_options={
                    "host": args.host,
                    "port": args.port,
                    # backstop for time spent in Serve's own queue; the app's own timeout answers first
                    "request_timeout_s": spec.settings.request_timeout_s + ray_serve.SHUTDOWN_MARGIN_S,
                },
            )
            board = start_board(drain_board_name(ray_serve.APP_NAME), NAMESPACE)
            if board is not None:  # else the replicas do not drain first: Serve's own graceful shutdown only
                spec = dataclasses.replace(spec, drain_board=drain_board_name(ray_serve.APP_NAME))
            deploy(serve, ray_serve.build_application(spec, options), options)
            starting[0] = False
        except _StoppedStarting:
            print("stopped while starting: removing the deployment", flush=True)
            with contextlib.suppress(Exception):  # nothing deployed yet, or Serve not started
                serve.delete(ray_serve.APP_NAME)
            return 0
        except StartupError:
            with contextlib.suppress(Exception):  # what was deployed, if anything
                serve.delete(ray_serve.APP_NAME)
            raise
        what = (
            f"{options.replicas} replica(s)"
            if not options.autoscaling
            else f"{options.replicas} replica(s), autoscaling {options.min_replicas or 1}..{options.max_replicas}"
        )
        print(f"dicache on Ray Serve: {what} at http://{args.host}:{args.port} (Ctrl-C or SIGTERM stops)", flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping: every replica finishes its requests first", flush=True)
        grace, log = spec.settings.drain_grace_s, logging.getLogger("dicache.server")
        try:
            if board is not None:
                unaware = begin_drain(board)
                if unaware:
                    log.warning("drain: replica(s) %s not reached (dead or busy)", unaware)
                print(
                    f"draining: every replica answers new requests 503; accepted generations have {grace:g} s "
                    "(signal again to stop them now, a third time to stop waiting)",
                    flush=True,
                )
            pending = (
                {}
                if board is None
                else wait_drained(
                    board,
                    grace + ray_serve.ANSWER_TIMEOUT_S + DRAIN_MARGIN_S,
                    hurry=lambda: signals[0] >= 2,
                    stop=lambda: signals[0] >= 3,
                )
            )
        except Exception as exc:  # the board died: Serve's own graceful shutdown still finishes the requests
            log.warning("drain: the drain board failed (%s)", exc)
            pending = {"?": 0}
        if pending:
            log.warning("drain: replica(s) %s not drained in time", sorted(pending))
        elif board is not None:
            print("drained: every replica answered its requests", flush=True)
        serve.delete(ray_serve.APP_NAME)
    finally:
        for name in (board_name(ray_serve.APP_NAME), drain_board_name(ray_serve.APP_NAME)):
            with contextlib.suppress(ValueError):  # ValueError: not created (no replica got that far, or no deploy)
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        if address is None:
            serve.shutdown()
        ray.shutdown()
    return 0
