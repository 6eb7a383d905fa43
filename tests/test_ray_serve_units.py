"""The Ray Serve layer's parts that need no Ray: options and their errors, the deployment's resources, the builder's
argument mapping, `/metrics` aggregation, the proxy's error rewriting, and the single-process server without Ray.
(The live deployment is tested in test_ray_serve.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dicache.cli import main as cli_main
from dicache.commands.serve import parse_serve_argv
from dicache.commands.serve_ray import args_to_argv, replica_spec_from_args, serve_options_from_args
from dicache.errors import ConfigError
from dicache.server import ServerSettings
from dicache.server.metrics import ServerMetrics
from dicache.server.metrics_merge import merge_expositions
from dicache.server.ray.builder import replica_from_options
from dicache.server.ray.deployment import REPLICA_HEADER, ReplicaHeaderMiddleware, deployment_options
from dicache.server.ray.metrics import MetricsBoard
from dicache.server.ray.options import RayServeOptions
from dicache.server.ray.proxy import ServeErrorsMiddleware, translate
from dicache.server.ray.resources import check_fits
from dicache.server.ray.spec import ReplicaSpec
from dicache.server.ray.startup import (
    PROXY_CHECKS,
    WORKER_NICENESS_ENV,
    local_cluster_environment,
    proxy_environment,
    summary,
    wait_for_proxy_up_to,
)
from dicache.settings.profiles import cache_config as read_cache_config


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(replicas=0), "--replicas=0 is invalid: must be an integer >= 1"),
        (dict(replicas=True), "--replicas=True is invalid"),
        (dict(min_replicas=1), "--min-replicas needs --max-replicas"),
        (dict(target_ongoing_requests=2.0), "--target-ongoing-requests needs --max-replicas"),
        (dict(replicas=5, max_replicas=4), "--replicas=5 is invalid with autoscaling"),
        (dict(replicas=1, min_replicas=2, max_replicas=4), "between --min-replicas=2 and --max-replicas=4"),
        (dict(max_replicas=2, target_ongoing_requests=0), "--target-ongoing-requests=0 is invalid"),
        (dict(cpus_per_replica=float("nan")), "--cpus-per-replica=nan is invalid: must be a finite number > 0"),
        (dict(gpus_per_replica=-1), "--gpus-per-replica=-1 is invalid: must be a finite number >= 0"),
        (dict(proxy_start_timeout_s=0.0), "--proxy-start-timeout=0.0 is invalid: must be a finite number > 0"),
        (dict(replica_health_timeout_s=float("inf")), "--replica-health-timeout=inf is invalid: must be a finite"),
        (dict(replica_start_timeout_s=-1.0), "--replica-start-timeout=-1.0 is invalid: must be a finite number > 0"),
    ],
)
def test_bad_options_name_the_flag_and_the_bound(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RayServeOptions(**kwargs)


def test_fixed_replicas_deployment():
    spec = ReplicaSpec(settings=ServerSettings(workers=2, max_queue=5, request_timeout_s=300))
    config = deployment_options(spec, RayServeOptions(replicas=3, cpus_per_replica=2, gpus_per_replica=1))
    assert config["num_replicas"] == 3 and "autoscaling_config" not in config
    assert config["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    assert config["max_ongoing_requests"] == 7 and config["max_queued_requests"] == 5  # workers + queue; queue
    assert config["graceful_shutdown_timeout_s"] == 310  # the longest request, plus a margin
    assert "placement_group_bundles" not in config


def test_health_and_start_up_timeouts_come_from_the_options():
    """The replicas' health checks go into the deployment; the proxy's timeouts into the environment of Serve's
    controller, under the names the installed Ray reads (checked in a fresh interpreter)."""
    defaults = deployment_options(ReplicaSpec(), RayServeOptions())
    assert (defaults["health_check_period_s"], defaults["health_check_timeout_s"]) == (10.0, 60.0)
    args = parse_serve_argv(["--ray", "--replica-health-period", "5", "--replica-health-timeout", "120"])
    config = deployment_options(ReplicaSpec(), serve_options_from_args(args, replica_spec_from_args(args, None)))
    assert (config["health_check_period_s"], config["health_check_timeout_s"]) == (5.0, 120.0)
    options = RayServeOptions(proxy_start_timeout_s=45.0, proxy_health_timeout_s=20.0)
    env = proxy_environment(options)
    assert env == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "15.0", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "20.0"}
    pytest.importorskip("ray")
    code = (
        "from ray.serve._private import constants as c; "
        "print(c.PROXY_READY_CHECK_TIMEOUT_S, c.PROXY_HEALTH_CHECK_TIMEOUT_S, c.PROXY_HEALTH_CHECK_UNHEALTHY_THRESHOLD)"
    )
    read = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert read.stdout.split() == ["15.0", "20.0", str(PROXY_CHECKS)], read.stderr[-2000:]


def test_docs_state_the_timeouts_as_declared():
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    timeouts = [name for name in RayServeOptions.model_fields if name.endswith(("_timeout_s", "_period_s"))]
    assert len(timeouts) == 5
    for name in timeouts:  # docs/serving.md's table of them: | `--flag` | default [Ray's own] | ...
        field = RayServeOptions.model_fields[name]
        assert f"| `{field.json_schema_extra['flag']}` | {field.default:g} [" in page, name


def test_the_driver_waits_for_the_proxy_as_long_as_the_option_says():
    """Ray 2.60's `serve.start` / `serve.run` wait a fixed 60 s for the proxy, read from these module constants."""
    pytest.importorskip("ray")
    import importlib

    modules = [importlib.import_module(f"ray.serve._private.{name}") for name in ("api", "client")]
    saved = [module.HTTP_PROXY_TIMEOUT for module in modules]
    try:
        wait_for_proxy_up_to(100.0)
        assert [module.HTTP_PROXY_TIMEOUT for module in modules] == [100.0, 100.0]
    finally:
        for module, value in zip(modules, saved):
            module.HTTP_PROXY_TIMEOUT = value


def test_autoscaling_deployment_and_its_default_target():
    spec = ReplicaSpec(settings=ServerSettings(workers=2))
    config = deployment_options(spec, RayServeOptions(replicas=2, min_replicas=0, max_replicas=8))
    assert "num_replicas" not in config
    assert config["autoscaling_config"] == {
        "min_replicas": 0,
        "max_replicas": 8,
        "initial_replicas": 2,
        "target_ongoing_requests": 2.0,
    }
    tuned = deployment_options(spec, RayServeOptions(max_replicas=4, target_ongoing_requests=1.5))
    assert tuned["autoscaling_config"]["min_replicas"] == 1
    assert tuned["autoscaling_config"]["target_ongoing_requests"] == 1.5


def test_tp_x_ulysses_replica_reserves_one_gpu_per_rank_in_one_placement_group():
    spec = ReplicaSpec(tp_size=2, ulysses_degree=2)
    config = deployment_options(spec, RayServeOptions(gpus_per_replica=4, cpus_per_replica=4))
    assert config["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1.0}
    assert config["placement_group_bundles"] == [
        {"CPU": 4.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]
    assert config["placement_group_strategy"] == "STRICT_PACK"
    on_cpus = deployment_options(ReplicaSpec(ulysses_degree=2), RayServeOptions())
    assert on_cpus["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    with pytest.raises(ConfigError, match=r"--gpus-per-replica=2 is invalid with --tp-size 2 × --ulysses-degree 2"):
        deployment_options(spec, RayServeOptions(gpus_per_replica=2))
    with pytest.raises(ConfigError, match="--gpus-per-replica=1 needs a CUDA device, but --device='cpu'"):
        deployment_options(ReplicaSpec(device="cpu"), RayServeOptions(gpus_per_replica=1))


def test_replicas_that_a_cluster_cannot_hold_are_refused_naming_the_option():
    spec, tp = ReplicaSpec(), ReplicaSpec(tp_size=2)
    check_fits(spec, RayServeOptions(replicas=2), {"CPU": 2.0}, "here")
    check_fits(spec, RayServeOptions(replicas=10, cpus_per_replica=0.1, gpus_per_replica=0.1), {"CPU": 1, "GPU": 1}, "")
    check_fits(tp, RayServeOptions(cpus_per_replica=1, gpus_per_replica=2), {"CPU": 2.0, "GPU": 2.0}, "here")
    with pytest.raises(ConfigError, match=r"--replicas=1 × 2 GPU\(s\) per replica \(--gpus-per-replica, --tp-size"):
        check_fits(tp, RayServeOptions(gpus_per_replica=2), {"CPU": 16.0}, "here")
    with pytest.raises(ConfigError, match=r"= 3 CPU\(s\), but the local Ray cluster has 2: lower --replicas or"):
        check_fits(spec, RayServeOptions(replicas=3), {"CPU": 2.0}, "the local Ray cluster")
    with pytest.raises(ConfigError, match=r"= 1 GPU\(s\), but here has 0: .* or serve on CPUs with --device cpu"):
        check_fits(spec, RayServeOptions(gpus_per_replica=1), {"CPU": 8.0}, "here")


def test_serve_ray_warns_like_the_single_process_server_and_about_ignored_connection_options():
    from dicache.commands.serve_ray import ray_warnings

    args = parse_serve_argv(["--ray", "--host", "0.0.0.0", "--max-connections", "50", "--keep-alive-timeout", "2"])
    exposed, ignored = ray_warnings(args, replica_spec_from_args(args, None).settings)
    assert "--host 0.0.0.0 is reachable from other machines and no API key is set" in exposed
    assert ignored.startswith("--max-connections, --keep-alive-timeout: ignored with --ray")
    quiet = parse_serve_argv(["--ray", "--host", "0.0.0.0", "--api-key", "k", "--body-timeout", "5"])
    assert ray_warnings(quiet, replica_spec_from_args(quiet, None).settings) == []


LOCAL_CLUSTER_ENV = (*local_cluster_environment(RayServeOptions()), "RAY_USAGE_STATS_ENABLED")


def _unset_local_cluster_env(monkeypatch) -> None:
    """Remove what `dicache serve --ray` / `app_builder` set for a local cluster, and have it removed (or restored)
    after the test: a value left in this process's environment would reach the commands the live tests start."""
    for name in LOCAL_CLUSTER_ENV:
        monkeypatch.setenv(name, "")  # recorded, so that the variable is restored (or removed) after
        monkeypatch.delenv(name)


@pytest.fixture
def fake_serve(monkeypatch):
    """A `FakeServe`; the signal handlers that `dicache serve --ray` installs are put back after the test."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    try:
        yield FakeServe(monkeypatch)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class FakeServe:
    """Ray and Serve for `dicache serve --ray` without a cluster: records the calls; `proxies` / `replicas` are what
    `serve.status()` reports; `start` / `run` replace `serve.start` / `serve.run`."""

    def __init__(self, monkeypatch) -> None:
        import types

        ray = pytest.importorskip("ray")
        from ray import serve

        self.calls: list[str] = []
        self.started: dict = {}
        self.proxies, self.replicas = {"node1": "HEALTHY"}, {"RUNNING": 1}
        self.start = lambda **kw: None
        self.run = lambda *a, **kw: None
        context = types.SimpleNamespace(address_info={"gcs_address": "local"})

        def status():
            deployment = types.SimpleNamespace(replica_states=dict(self.replicas))
            app = types.SimpleNamespace(deployments={"DicacheServer": deployment})
            return types.SimpleNamespace(proxies=dict(self.proxies), applications={"dicache": app})

        def start(**kwargs):
            self.calls.append("serve.start")
            self.started = kwargs
            self.start(**kwargs)

        def run(*args, **kwargs):
            self.calls.append("serve.run")
            self.run(*args, **kwargs)

        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        _unset_local_cluster_env(monkeypatch)
        monkeypatch.setattr(ray, "init", lambda **kw: self.calls.append("init") or context)
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
        monkeypatch.setattr(ray, "shutdown", lambda: self.calls.append("shutdown"))
        monkeypatch.setattr(ray, "get_actor", lambda *a, **kw: (_ for _ in ()).throw(ValueError("no metrics board")))
        monkeypatch.setattr(serve, "start", start)
        monkeypatch.setattr(serve, "run", run)
        monkeypatch.setattr(serve, "status", status)
        monkeypatch.setattr(serve, "delete", lambda name: self.calls.append("serve.delete"))
        monkeypatch.setattr(serve, "shutdown", lambda: self.calls.append("serve.shutdown"))
        monkeypatch.setattr("dicache.server.ray.startup.wait_for_proxy_up_to", lambda seconds: None)


def _start_failure(fake: FakeServe, capsys, *flags: str) -> str:
    """Run `dicache serve --ray` against `fake`: it must fail with exit status 1 and one line on stderr, clean up,
    and give back the SIGALRM handler and timer it borrowed (here pytest-timeout's); returns the line."""
    import signal

    handler, timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]
    assert cli_main(["serve", "--ray", "--device", "cpu", "--port", "30299", *flags]) == 1
    assert signal.getsignal(signal.SIGALRM) == handler
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer > 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert fake.calls[-3:] == ["serve.delete", "serve.shutdown", "shutdown"]
    return err.strip()


def test_a_proxy_that_does_not_start_in_time_is_one_line_naming_the_option(fake_serve, monkeypatch, capsys):
    """Serve's controller keeps restarting a proxy that missed its readiness checks, while `serve.start` may already
    have returned: the command waits for the controller's verdict, then fails naming --proxy-start-timeout."""
    fake = fake_serve
    fake.proxies = {"node1": "STARTING"}
    monkeypatch.setattr("dicache.server.ray.startup.PROXY_WAIT_MARGIN_S", 0.1)
    line = _start_failure(fake, capsys, "--proxy-start-timeout", "1.5", "--proxy-health-timeout", "40")
    assert line == (
        "dicache serve: error: Ray Serve's HTTP proxy did not start within --proxy-start-timeout=1.5 s (after 1.6 s "
        "a proxy is STARTING); on a busy machine, raise --proxy-start-timeout"
    )
    assert "serve.run" not in fake.calls
    env = fake.started["controller_options"]["runtime_env"]["env_vars"]  # 3 readiness checks of 0.5 s
    assert env == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "0.5", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "40.0"}


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (  # the proxy raised: its port is taken
            type("RayTaskError", (Exception,), {"cause": RuntimeError("Failed to bind to address '0.0.0.0:30299'.")}),
            "Ray Serve's HTTP proxy failed to start: Failed to bind to address '0.0.0.0:30299'.",
        ),
        (  # Serve's controller gave up on the proxy before it answered the driver
            lambda: RuntimeError("The actor died unexpectedly.\n\tclass_name: ProxyActor\nkilled by `ray.kill`."),
            "did not start within --proxy-start-timeout=90 s (The actor died unexpectedly. ... killed by `ray.kill`.)",
        ),
    ],
)
def test_serve_start_errors_are_one_line(fake_serve, capsys, error, expected):
    fake = fake_serve

    def failing(**kwargs):
        raise error()

    fake.start = failing
    assert expected in _start_failure(fake, capsys)


def test_replicas_that_do_not_start_in_time_are_one_line_naming_the_option(fake_serve, capsys):
    fake = fake_serve
    fake.replicas = {"STARTING": 1, "RUNNING": 1}

    def loading(*args, **kwargs):  # serve.run waits for replicas that take longer than the option allows
        for _ in range(100):
            time.sleep(0.05)
        fake.calls.append("serve.run returned")

    fake.run = loading
    line = _start_failure(fake, capsys, "--replica-start-timeout", "0.5")
    assert line == (
        "dicache serve: error: Ray Serve's replicas did not start within --replica-start-timeout=0.5 s (replicas: "
        "1 RUNNING, 1 STARTING); on a slow or busy machine, raise --replica-start-timeout"
    )
    assert "serve.run returned" not in fake.calls


def test_a_replica_that_fails_to_start_is_one_line(fake_serve, capsys):
    fake = fake_serve

    def failing(*args, **kwargs):
        raise RuntimeError(
            "Deploying application dicache failed: replica constructor raised\nTraceback (most recent call last):\n"
            '  File "x.py", line 1\nOSError: no checkpoint at /models/krea2'
        )

    fake.run = failing
    line = _start_failure(fake, capsys)
    assert line == (
        "dicache serve: error: Ray Serve could not start the replicas: Deploying application dicache failed: replica "
        "constructor raised ... OSError: no checkpoint at /models/krea2"
    )
    assert summary(RuntimeError("x" * 400)) == "x" * 297 + "..."


def test_serve_ray_refuses_gpus_a_local_cluster_lacks_before_deploying(fake_serve, capsys, caplog):
    """On a machine without GPUs, --gpus-per-replica / --tp-size with GPUs is a usage error once the local
    cluster shows its resources, instead of a deployment that waits forever for GPUs."""
    fake = fake_serve
    argv = ["serve", "--ray", "--device", "cuda", "--tp-size", "2", "--port", "30299", "--host", "0.0.0.0"]
    assert cli_main(argv) == 2
    assert "--host 0.0.0.0 is reachable from other machines and no API key is set" in caplog.text
    assert "--replicas=1 × 2 GPU(s) per replica" in capsys.readouterr().err
    assert "serve.start" not in fake.calls and "serve.run" not in fake.calls and fake.calls[-1] == "shutdown"


def test_serve_ray_stopped_while_its_replicas_start_cleans_up_and_exits_0(fake_serve, capsys):
    """SIGTERM while `serve.run` waits for the replicas to load (minutes with big weights): the start-up stops, the
    cluster is shut down and the command exits 0 (Ray's own handler used to abort the process, status 134)."""
    import signal

    fake = fake_serve

    def loading(*args, **kwargs):  # a deployment that takes its time; the orchestrator sends SIGTERM meanwhile
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.05)
        fake.calls.append("serve.run returned")

    def unhandled(*_):
        raise AssertionError("SIGTERM during start-up was left to the default handler")

    fake.run = loading
    signal.signal(signal.SIGTERM, unhandled)
    assert cli_main(["serve", "--ray", "--device", "cpu", "--port", "30299"]) == 0
    assert "serve.run returned" not in fake.calls
    assert fake.calls[-3:] == ["serve.delete", "serve.shutdown", "shutdown"]
    assert "stopped while starting" in capsys.readouterr().out


def test_command_line_options_become_spec_and_options():
    args = parse_serve_argv(
        ["--ray", "--replicas", "2", "--max-replicas", "6", "--tp-size", "2", "--max-queue", "3", "--device", "cuda"]
    )
    spec = replica_spec_from_args(args, cache_config=None)
    assert spec.world_size == 2 and spec.settings.max_queue == 3 and spec.device == "cuda"
    options = serve_options_from_args(args, spec)
    assert (options.replicas, options.max_replicas, options.gpus_per_replica) == (2, 6, 2.0)  # cuda: 1 per rank
    cpu = parse_serve_argv(["--ray"])
    assert serve_options_from_args(cpu, replica_spec_from_args(cpu, None), cluster_gpus=0).gpus_per_replica == 0
    assert serve_options_from_args(cpu, replica_spec_from_args(cpu, None), cluster_gpus=8).gpus_per_replica == 1
    with pytest.raises(ConfigError, match="--tp-size=0 is invalid"):
        bad = parse_serve_argv(["--ray", "--tp-size", "0"])
        serve_options_from_args(bad, replica_spec_from_args(bad, None))


def test_builder_args_map_to_the_same_options_and_errors():
    argv = args_to_argv({"replicas": 2, "max_queue": 8, "ray": True, "profile": None, "default_size": "64x64"})
    assert argv == ["--replicas", "2", "--max-queue", "8", "--ray", "--default-size", "64x64"]
    assert args_to_argv({"enable": False}) == []
    assert args_to_argv({"artifact_weights": False}) == ["--artifact-weights", "false"]  # a switch on by default
    assert parse_serve_argv(args_to_argv({"artifact_weights": False, "ray": True})).artifact_weights is False
    assert parse_serve_argv(argv).default_size == (64, 64)
    with pytest.raises(ConfigError, match="unrecognized arguments: --replica 2"):
        parse_serve_argv(args_to_argv({"replica": 2}))
    with pytest.raises(ConfigError, match="argument --replicas: 'two' is invalid: must be an integer"):
        parse_serve_argv(args_to_argv({"replicas": "two"}))


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"replicas": 2, "max_queue": 8, "device": "cpu", "default_size": "64x64", "profile": None},
        {"replicas": "2", "max_replicas": "4", "target_ongoing_requests": "1.5", "tp_size": "2", "device": "cuda"},
        {"timeout": "30", "workers": 2, "max_side": 512, "max_n": "2", "drain_timeout": 0, "docs": True},
        {"variant": "raw", "dtype": "bfloat16", "torch_threads": 2, "model": "some/dir", "ulysses_degree": 2},
        {"compile": True, "quantization": "fp8", "quantization_exclude": ["attn_gate"], "load_format": "dummy"},
        {"compile": True, "text_encoder_quantization": "fp8", "compile_artifact": "/a", "artifact_weights": False},
        {"api_key": "k", "metrics_auth": True, "max_connections": 10, "cpus_per_replica": 0.5, "gpus_per_replica": 0},
    ],
)
def test_builder_builds_from_the_declared_options_what_the_command_line_builds(args, monkeypatch):
    """`app_builder`'s args go to the declared options (no argv): the same replica and deployment as the command
    line's parser gives for the same options, text values (`serve run key=value`) included."""
    monkeypatch.delenv("DICACHE_API_KEY", raising=False)
    spec, options = replica_from_options(args)
    parsed = parse_serve_argv(args_to_argv(args))
    expected = replica_spec_from_args(parsed, read_cache_config(parsed.profile))
    assert spec == expected
    assert options == serve_options_from_args(parsed, expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"replica": 2}, r"unknown option\(s\) 'replica'; allowed: .*replicas"),
        ({"dit_layerwise_offload": True}, r"unknown option\(s\) 'dit_layerwise_offload'"),
        ({"replicas": "two"}, "--replicas='two' is invalid: must be an integer >= 1"),
        ({"variant": "fast"}, "--variant='fast' is invalid: must be one of 'turbo', 'raw'"),
        ({"tp_size": 0}, "--tp-size=0 is invalid: must be an integer >= 1"),
        ({"default_size": "60x60"}, "'60x60' is invalid: each side must be a multiple of 16"),
        ({"load_format": "fast"}, "load_format='fast' is invalid: must be one of auto, dummy"),
        ({"max_queue": -1}, "max_queue=-1 is invalid"),
        ({"metrics_auth": True}, "--metrics-auth needs an API key"),
        ({"max_connections": 0}, "max_connections=0 is invalid"),
    ],
)
def test_builder_args_name_the_bad_option(args, message, monkeypatch):
    monkeypatch.delenv("DICACHE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=message):
        replica_from_options(args)


def test_serve_run_with_the_builder_gives_its_local_cluster_the_openai_shaped_proxy_errors(monkeypatch):
    """`serve run dicache.server.ray_serve:app_builder ...` builds the app before it starts a local Ray cluster: the
    builder sets the proxy callback variable that the cluster inherits, unless the environment already has one."""
    ray = pytest.importorskip("ray")
    from dicache.server.ray.builder import app_builder
    from dicache.server.ray.proxy import CALLBACK_ENV, CALLBACK_PATH

    assert not ray.is_initialized()
    _unset_local_cluster_env(monkeypatch)
    names = (CALLBACK_ENV, WORKER_NICENESS_ENV, "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    app_builder({"replicas": "2", "device": "cpu", "proxy_start_timeout": "60"})
    assert [os.environ[name] for name in names] == [CALLBACK_PATH, "0", "20.0"]  # and Ray's workers at our priority
    monkeypatch.setenv(CALLBACK_ENV, "mine:callback")
    app_builder({"device": "cpu"})
    assert os.environ[CALLBACK_ENV] == "mine:callback"


def test_the_earlier_builder_path_is_the_builder():
    """Serve configs and KubeRay manifests written for `dicache.server.ray_serve:app_builder` keep building the app."""
    from dicache.server import ray_serve
    from dicache.server.ray.builder import app_builder

    assert ray_serve.app_builder is app_builder


def test_serve_ray_starts_its_local_cluster_with_the_proxy_settings_and_workers_at_its_priority(fake_serve):
    """Ray runs its workers at nice 15 by default: next to any busy process, Serve's proxy and the replicas got a
    few per cent of a core and did not start in time."""
    from dicache.server.ray.proxy import CALLBACK_ENV, CALLBACK_PATH

    fake = fake_serve
    names = (CALLBACK_ENV, WORKER_NICENESS_ENV, "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    seen = {}
    fake.start = lambda **kw: seen.update({name: os.environ.get(name) for name in names})
    fake.run = lambda *a, **kw: os.kill(os.getpid(), __import__("signal").SIGTERM)  # started: now stop
    assert cli_main(["serve", "--ray", "--device", "cpu", "--port", "30299", "--proxy-start-timeout", "45"]) == 0
    assert seen == dict(zip(names, [CALLBACK_PATH, "0", "15.0"]))
    env = fake.started["controller_options"]["runtime_env"]["env_vars"]  # and on a cluster of its own
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "15.0"


def test_serve_help_lists_the_ray_options(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--ray", "--replicas", "--min-replicas", "--max-replicas", "--target-ongoing-requests"):
        assert flag in text
    assert "--gpus-per-replica" in text and "--ray-address" in text
    for flag in (
        "--proxy-start-timeout",
        "--proxy-health-timeout",
        "--replica-health-timeout",
        "--replica-start-timeout",
    ):
        assert flag in text


def test_without_ray_the_single_process_server_works_and_serve_ray_says_what_to_install():
    """In a fresh interpreter where `import ray` fails: the app serves, and `--ray` names the extra to install."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from fastapi.testclient import TestClient\n"
        "from dicache.server import create_app, ServerSettings\n"
        "from dicache.server.generation import Defaults\n"
        "from dicache.settings.cache_config import CacheConfig\n"
        "class B:\n"
        "    cache_config = CacheConfig.defaults(); num_blocks = 4\n"
        "    defaults = Defaults('turbo', 8, 1.0, 64, 64)\n"
        "    def generate(self, spec, should_stop=None): raise RuntimeError\n"
        "with TestClient(create_app(B(), ServerSettings())) as c:\n"
        "    assert c.get('/health').status_code == 200\n"
        "from dicache.cli import main\n"
        "sys.exit(main(['serve', '--ray', '--replicas', '2']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "dicache serve --ray needs the ray extra: pip install 'dicache[ray]'" in done.stderr


# ---------------------------------------------------------------------------------------------- /metrics
def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_merged_metrics_label_each_replica_and_keep_its_values():
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_request("/health", 200, 0.1)
    a.observe_generation(3, 5, 0.4)
    b.observe_request("/health", 200, 0.2)
    b.observe_request("/health", 200, 0.2)
    merged = _samples(merge_expositions({"r1": a.render()[0], "r2": b.render()[0]}))
    key = "dicache_http_requests_total"
    assert merged[(key, (("endpoint", "/health"), ("replica", "r1"), ("status", "200")))] == 1
    assert merged[(key, (("endpoint", "/health"), ("replica", "r2"), ("status", "200")))] == 2
    assert merged[("dicache_transformer_calls_total", (("kind", "cached"), ("replica", "r1")))] == 5
    assert merged[("dicache_transformer_calls_total", (("kind", "cached"), ("replica", "r2")))] == 0
    count = "dicache_http_request_duration_seconds_count"
    assert merged[(count, (("endpoint", "/health"), ("replica", "r2")))] == 2
    conflicting = "# TYPE dicache_queue_depth counter\ndicache_queue_depth_total 1.0\n"
    with pytest.raises(ValueError, match="'dicache_queue_depth'"):
        merge_expositions({"r1": a.render()[0], "r2": conflicting})


def test_metrics_board_forgets_replicas_that_stop_posting():
    now = [0.0]
    board = MetricsBoard(ttl_s=5, clock=lambda: now[0])
    assert board.exchange("a", b"A1") == {}
    now[0] = 2
    assert board.exchange("b", b"B1") == {"a": b"A1"}
    now[0] = 4
    assert board.exchange("a", b"A2") == {"b": b"B1"}
    now[0] = 8  # b last posted at 2: gone
    assert board.exchange("a", b"A3") == {} and board.replicas() == ["a"]
    board.exchange("c", b"C1")
    board.leave("c")
    assert board.replicas() == ["a"]
    with pytest.raises(ValueError, match="ttl_s=0"):
        MetricsBoard(ttl_s=0)


# ---------------------------------------------------------------------------------------------- proxy errors
def _run(middleware, path: str = "/v1/images/generations") -> tuple[int, dict[str, str], bytes]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": "http", "path": path, "method": "POST"}, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def _answering(status: int, body: bytes, content_type: bytes = b"text/plain; charset=utf-8"):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body[:3], "more_body": True})
        await send({"type": "http.response.body", "body": body[3:], "more_body": False})

    return app


async def _silent(scope, receive, send):  # Serve's proxy when the replica died mid-request: no answer at all
    return None


async def _raising(scope, receive, send):
    raise RuntimeError("ActorDiedError: the actor died unexpectedly")


@pytest.mark.parametrize(
    ("inner", "status", "code", "retry", "words"),
    [
        (_silent, 503, "replica_unavailable", "1", "stopped or failed before answering"),
        (_raising, 503, "replica_unavailable", "1", "ActorDiedError"),
        (_answering(500, b"Internal Server Error"), 503, "replica_unavailable", "1", "retry"),
        (
            _answering(503, b"Request dropped due to backpressure (num_queued_requests=8, max_queued_requests=8)."),
            429,
            "queue_full",
            "1",
            "max_queued_requests=8",
        ),
        (_answering(503, b"This node is being drained."), 503, "unavailable", "1", "being drained"),
        (_answering(408, b"Request abc timed out after 60.0s."), 504, "timeout", None, "timed out after 60.0s"),
    ],
)
def test_serve_own_failures_become_openai_errors(inner, status, code, retry, words):
    got, headers, body = _run(ServeErrorsMiddleware(inner))
    error = json.loads(body)["error"]
    assert got == status and error["code"] == code and words in error["message"]
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    assert headers.get("retry-after") == retry


def test_app_answers_and_serve_endpoints_pass_unchanged():
    app_error = json.dumps({"error": {"message": "bad size", "code": None}}).encode()
    assert _run(ServeErrorsMiddleware(_answering(400, app_error, b"application/json")))[::2] == (400, app_error)
    metrics = b"# TYPE x gauge\nx 1.0\n"
    assert _run(ServeErrorsMiddleware(_answering(200, metrics)))[::2] == (200, metrics)
    drained = b"This node is being drained."
    assert _run(ServeErrorsMiddleware(_answering(503, drained)), path="/-/healthz")[::2] == (503, drained)
    assert translate(404, "Path '/x' not found.")[:3] == (404, "Path '/x' not found.", None)


def test_replica_header_on_every_answer():
    status, headers, body = _run(ReplicaHeaderMiddleware(_answering(200, b"ok!!"), replica="abc123"))
    assert (status, headers[REPLICA_HEADER], body) == (200, "abc123", b"ok!!")


def test_serve_ray_rejects_bad_options_before_starting_a_cluster(capsys):
    ray = pytest.importorskip("ray")
    assert cli_main(["serve", "--ray", "--tp-size", "2", "--gpus-per-replica", "1", "--device", "cuda"]) == 2
    assert "--gpus-per-replica=1 is invalid with --tp-size 2 × --ulysses-degree 1" in capsys.readouterr().err
    assert cli_main(["serve", "--ray", "--replicas", "3", "--max-replicas", "2"]) == 2
    assert "--replicas=3 is invalid with autoscaling" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a number at all: argparse's usage error, worded like the others
        cli_main(["serve", "--ray", "--replicas", "abc"])
    assert "argument --replicas: 'abc' is invalid: must be an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--ray", "--cpus-per-replica", "two"])
    assert "argument --cpus-per-replica: 'two' is invalid: must be a number" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_replicas_get_the_speed_options_and_refuse_offload():
    """`--compile`, `--quantization` and `--load-format` reach every replica (applied after any split, then a
    warm-up); the memory options, which plan one process's GPU, are refused before a cluster starts."""
    from dicache.quantization import QuantizationSpec
    from dicache.settings.cache_config import CacheConfig

    args = parse_serve_argv(["--ray", "--compile", "--quantization", "fp8", "--load-format", "dummy"])
    spec = replica_spec_from_args(args, CacheConfig())
    assert spec.compile is True and spec.load_format == "dummy" and spec.quantization == QuantizationSpec()
    plain = replica_spec_from_args(parse_serve_argv(["--ray"]), CacheConfig())
    assert plain.compile is False and plain.quantization is None and plain.load_format == "auto"
    with pytest.raises(ConfigError, match="--dit-layerwise-offload.*not supported on Ray replicas"):
        replica_spec_from_args(parse_serve_argv(["--ray", "--dit-layerwise-offload"]), CacheConfig())
    encoder = replica_spec_from_args(parse_serve_argv(["--ray", "--text-encoder-quantization", "fp8"]), CacheConfig())
    assert encoder.text_encoder_quantization == "fp8" and plain.text_encoder_quantization is None


def test_replica_applies_speed_options_in_order_then_starts_up_as_dicache_serve(monkeypatch):
    from dicache.server import backend as backend_module
    from dicache.server.ray.spec import ReplicaSpec

    calls = []
    monkeypatch.setattr(backend_module, "release_cached_memory", lambda device: calls.append(("release", device)))
    monkeypatch.setattr(backend_module, "freeze_start_up_objects", lambda: calls.append(("freeze",)))

    class Pipe:
        device = "cpu"

        def quantize(self, spec):
            calls.append(("quantize", spec))

        def quantize_text_encoder(self, method):
            calls.append(("quantize_text_encoder", method))

        def compile(self):
            calls.append(("compile",))

    class Backend:
        pipe = Pipe()

        def warm_up(self):
            calls.append(("warm_up",))
            return {}

        def prepare_text_lengths(self, background=False, **preparation):
            calls.append(("prepare_text_lengths", "background" if background else "now"))
            return {}

    ReplicaSpec(
        quantization="q", text_encoder_quantization="fp8", compile=True, prepare_text_lengths="before-ready"
    ).apply_speed(Backend())
    assert calls == [
        ("quantize", "q"),
        ("quantize_text_encoder", "fp8"),  # a split replica's text encoder: after the split, before the compile
        ("compile",),
        ("warm_up",),
        ("prepare_text_lengths", "now"),
        ("release", "cpu"),  # what quantisation and the warm-up left reserved, as `dicache serve` does
        ("freeze",),
    ]
    calls.clear()
    ReplicaSpec(compile=True).apply_speed(Backend())  # the default: the lengths follow once the replica is ready
    assert calls == [
        ("compile",),
        ("warm_up",),
        ("release", "cpu"),
        ("freeze",),
        ("prepare_text_lengths", "background"),
    ]
    calls.clear()
    ReplicaSpec(prepare_text_lengths="off").apply_speed(Backend())
    assert calls == [("release", "cpu"), ("freeze",)]


# ---------------------------------------------------------------------------------------------- drain on SIGTERM
def test_a_replica_is_given_its_drain_before_serve_stops_it():
    """Serve's graceful shutdown of a replica waits for the longer of the longest request and the app's drain."""
    from dicache.server.ray import deployment as ray_serve

    spec = ReplicaSpec(settings=ServerSettings(request_timeout_s=20, drain_grace_s=60))
    config = deployment_options(spec, RayServeOptions())
    assert config["graceful_shutdown_timeout_s"] == 60 + ray_serve.ANSWER_TIMEOUT_S + ray_serve.SHUTDOWN_MARGIN_S


def test_drain_board_waits_for_live_replicas_until_they_are_done():
    from dicache.server.ray.drain import DrainBoard

    now = [0.0]
    board = DrainBoard(ttl_s=3.0, clock=lambda: now[0])
    assert board.report("a", False, 2) == (False, False) and board.report("b", False, 0) == (False, False)
    board.begin()
    assert board.unaware() == ["a", "b"]  # their drains have not begun
    assert board.report("a", False, 2) == (True, False)  # told, not draining yet
    assert board.unaware() == ["a", "b"]
    board.report("a", False, 2, draining=True)
    assert board.unaware() == ["b"] and board.pending() == {"a": 2, "b": 0}
    board.report("b", True)
    assert board.pending() == {"a": 2}
    now[0] = 2.5
    board.hurry()
    assert board.report("a", False, 1) == (True, True)
    now[0] = 6.0  # "a" stopped reporting (died): not waited for
    assert board.pending() == {}


class _FakeDrain:
    def __init__(self) -> None:
        self.finished, self.draining, self.in_flight, self.hurried, self.runs = False, False, 0, False, 0

        class Queue:
            waiting = 0

        self.queue = Queue()

    async def run(self) -> None:
        self.runs += 1
        self.draining = self.finished = True

    def hurry(self) -> None:
        self.hurried = True


def test_a_replica_follows_the_board_and_keeps_serving_without_one(monkeypatch):
    """`follow` starts the app's drain when the board says so; without a board it just retries, never raising."""
    ray = pytest.importorskip("ray")
    from dicache.server.ray import drain as ray_drain

    board = ray_drain.DrainBoard()

    class Handle:  # a Ray actor handle over `board`, calls answered at once
        class report:  # noqa: N801
            @staticmethod
            def remote(*args):
                return board.report(*args)

    reachable = [False]

    def get_actor(name, namespace):
        if not reachable[0]:
            raise ValueError(f"Failed to look up actor {name}")
        return Handle

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray_drain, "RETRY_S", 0.05)
    monkeypatch.setattr(ray_drain, "POLL_S", 0.01)
    drain = _FakeDrain()

    async def scenario() -> None:
        task = asyncio.ensure_future(ray_drain.follow("board", "ns", "r1", drain))
        await asyncio.sleep(0.2)  # no board: keeps retrying, no drain
        assert not task.done() and drain.runs == 0
        reachable[0] = True
        await asyncio.sleep(0.2)
        assert drain.runs == 0 and board.pending() == {"r1": 0}
        board.hurry()
        await asyncio.sleep(0.2)
        assert drain.runs == 1 and drain.hurried and board.pending() == {}  # drained, and reported done
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_a_compiling_replica_takes_the_stores_bytecode_before_it_loads_its_model(tmp_path, monkeypatch):
    """As `dicache serve`'s entry: a replica with --compile and an artifact store reads its modules' bytecode from
    the store for the imports its loading does; without --compile nothing changes."""
    from dicache.models import artifact_bytecode
    from dicache.server import backend

    store = tmp_path / "store"
    folder = artifact_bytecode.folder(store)
    folder.mkdir(parents=True)
    seen = []
    monkeypatch.setattr(backend, "load_backend", lambda *args, **kwargs: seen.append(sys.pycache_prefix))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    ReplicaSpec(compile=True, compile_artifact=str(store), device="cpu").load_backend()
    monkeypatch.setattr(sys, "pycache_prefix", None)
    ReplicaSpec(compile=False, compile_artifact=str(store), device="cpu").load_backend()
    assert seen == [str(folder), None]
