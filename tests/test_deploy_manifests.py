"""deploy/: the Kubernetes manifests against the Kubernetes schemas (offline, `kubernetes-validate`, strict: an
unknown or misspelt field fails), and against the server they run (its options, timeouts, ports and pins).

- deploy/kubernetes/dicache-server.yaml: Deployment + Service of the single-process server;
- deploy/kuberay/dicache-rayservice.yaml: KubeRay RayService (a custom resource: its head and worker pod templates
  are validated as core PodTemplates; its serveConfigV2 is built with the same option parser as `dicache serve`);
- deploy/kubernetes/dicache-compile-artifacts.yaml, deploy/kuberay/dicache-warmup-job.yaml: the claim holding the
  compile artifacts and the Jobs that write them (`dicache warmup` with the serving options), mounted read-only where
  the servers load them (docs/startup.md).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

from dicache.commands.serve import parse_serve_argv, settings_from_args  # noqa: E402
from dicache.commands.serve_ray import args_to_argv, replica_spec_from_args, serve_options_from_args  # noqa: E402
from dicache.server.ray.builder import replica_from_options  # noqa: E402
from dicache.server.ray.deployment import deployment_options  # noqa: E402
from dicache.server.ray.proxy import CALLBACK_ENV, CALLBACK_PATH  # noqa: E402
from dicache.server.ray.startup import proxy_environment  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SERVER = DEPLOY / "kubernetes" / "dicache-server.yaml"
RAYSERVICE = DEPLOY / "kuberay" / "dicache-rayservice.yaml"
ARTIFACTS = DEPLOY / "kubernetes" / "dicache-compile-artifacts.yaml"
RAY_WARMUP = DEPLOY / "kuberay" / "dicache-warmup-job.yaml"
VERSIONS = ("1.30", kv.utils.latest_version())  # oldest Kubernetes we aim at, newest the package knows


def _docs(path: pathlib.Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _pod_template(template: dict, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def _ray_templates() -> dict[str, dict]:
    cluster = yaml.safe_load(RAYSERVICE.read_text())["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


def _ray_pin() -> str:
    return re.search(r'"ray\[serve\]==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


# ---------------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("version", VERSIONS)
def test_core_objects_match_the_kubernetes_schemas(version):
    docs = _docs(SERVER)
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service"]
    for doc in docs:
        kv.validate(doc, version, strict=True)
    for name, template in _ray_templates().items():
        kv.validate(_pod_template(template, name), version, strict=True)
    artifacts = _docs(ARTIFACTS) + _docs(RAY_WARMUP)
    assert sorted(d["kind"] for d in artifacts) == ["Job", "Job", "PersistentVolumeClaim"]
    for doc in artifacts:
        kv.validate(doc, version, strict=True)


def test_the_validation_catches_a_misspelt_or_mistyped_field():
    deployment = _kind(_docs(SERVER), "Deployment")
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinessprobe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError, match="readinessprobe"):
        kv.validate(misspelt, "1.30", strict=True)
    mistyped = copy.deepcopy(deployment)
    mistyped["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "330"
    with pytest.raises(kv.ValidationError):
        kv.validate(mistyped, "1.30", strict=True)


# ---------------------------------------------------------------------------------------------- single process
def test_single_process_deployment_fits_the_server_it_runs():
    docs = _docs(SERVER)
    deployment, service = _kind(docs, "Deployment"), _kind(docs, "Service")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["dicache", "serve"]
    args = parse_serve_argv(container["command"][2:])  # every option exists and parses
    settings = settings_from_args(args)
    port = next(p for p in container["ports"] if p["containerPort"] == args.port)

    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]
    assert args.device == "cuda"
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert container["livenessProbe"]["tcpSocket"]["port"] == port["name"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # the grace period covers the preStop wait plus the longest request the server accepts
    assert pod["spec"]["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + settings.request_timeout_s
    # on SIGTERM the server gives accepted requests --drain-timeout seconds (then answers them 503): it must cover
    # the longest request, and the grace period the drain plus the 15 s `dicache serve --help` asks for
    assert settings.drain_grace_s >= settings.request_timeout_s
    assert pod["spec"]["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + settings.drain_grace_s + 15
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == args.port
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


def _assert_compile_cache_on_a_writable_volume(pod_spec: dict, container: dict) -> None:
    env = {item["name"]: item.get("value") for item in container["env"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        path = env[variable]
        mount = next(m for root, m in mounts.items() if path.startswith(root.rstrip("/") + "/"))
        assert not mount.get("readOnly", False)
        assert "emptyDir" in volumes[mount["name"]] or "persistentVolumeClaim" in volumes[mount["name"]]


def test_compiled_server_keeps_its_compile_cache_on_a_writable_volume_and_has_time_to_compile():
    pod = _kind(_docs(SERVER), "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = parse_serve_argv(container["command"][2:])
    assert args.compile and args.quantization == "fp8"  # the fast path of docs/speed.md
    _assert_compile_cache_on_a_writable_volume(pod["spec"], container)
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900  # cold compile 6-8 min + loading


def test_compiled_ray_replicas_keep_their_compile_cache_on_a_writable_volume():
    rayservice = yaml.safe_load(RAYSERVICE.read_text())
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["compile"] is True and app["args"]["quantization"] == "fp8"
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod_spec = group["template"]["spec"]
        (container,) = pod_spec["containers"]
        _assert_compile_cache_on_a_writable_volume(pod_spec, container)


# ---------------------------------------------------------------------------------------------- RayService
def test_rayservice_serve_config_builds_with_the_dicache_serve_parser():
    rayservice = yaml.safe_load(RAYSERVICE.read_text())
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    args = parse_serve_argv(args_to_argv(app["args"]))  # unknown option or bad value: ConfigError
    spec = replica_spec_from_args(args, cache_config=None)
    options = serve_options_from_args(args, spec)
    config = deployment_options(spec, options)  # checks GPUs against tp x ulysses
    assert app["route_prefix"] == "/"
    built, built_options = replica_from_options(app["args"])  # what app_builder builds, from the declarations
    assert dataclasses.replace(built, cache_config=None) == spec and built_options == options

    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _ray_pin()
    (workers,) = cluster["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    gpus_per_pod = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"]
    assert 0 < options.gpus_per_replica <= gpus_per_pod  # a replica (all its ranks) fits on one worker pod
    assert options.max_replicas * options.gpus_per_replica <= workers["maxReplicas"] * gpus_per_pod
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"

    http = serve_config["http_options"]
    assert http["request_timeout_s"] >= spec.settings.request_timeout_s  # the proxy never cuts a request short
    grace = workers["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config["graceful_shutdown_timeout_s"]  # a draining replica may finish its longest request
    assert f"--deadline-remaining-seconds {grace - 10}" in " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health"
    serve_port = {p["name"]: p["containerPort"] for p in worker["ports"]}[worker["readinessProbe"]["httpGet"]["port"]]
    assert serve_port == http["port"]
    assert worker["livenessProbe"]["httpGet"]["path"] == "/api/local_raylet_healthz"

    head = cluster["headGroupSpec"]["template"]
    assert int(head["metadata"]["annotations"]["prometheus.io/port"]) == http["port"]  # aggregated /metrics
    assert head["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    for template in _ray_templates().values():
        for container in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env[CALLBACK_ENV] == CALLBACK_PATH
            assert importlib.import_module(CALLBACK_PATH.split(":")[0])
    (head_container,) = head["spec"]["containers"]
    head_env = {e["name"]: e.get("value") for e in head_container["env"]}
    for name, value in proxy_environment(options).items():  # the proxy's timeouts, where Serve's controller runs
        assert float(head_env[name]) == float(value), name


def _serving_containers() -> dict[str, dict]:
    (deployment,) = [d for d in _docs(SERVER) if d["kind"] == "Deployment"]
    (single,) = deployment["spec"]["template"]["spec"]["containers"]
    found = {"single-process": single}
    for name, template in _ray_templates().items():
        (container,) = template["spec"]["containers"]
        found[f"ray-{name}"] = container
    return found


def test_every_serving_pod_takes_the_api_key_from_a_secret(monkeypatch):
    for name, container in _serving_containers().items():
        (key,) = [e for e in container.get("env", []) if e["name"] == "DICACHE_API_KEY"]
        ref = key["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref.get("optional", False)) == ("dicache-api-key", "api-key", False), name
        assert "value" not in key and not any("api-key" in str(arg) for arg in container.get("command", [])), name

    # with the Secret's value in the environment, both manifests' servers require it
    monkeypatch.setenv("DICACHE_API_KEY", "from-the-secret")
    (deployment,) = [d for d in _docs(SERVER) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_serve_argv(container["command"][2:])
    assert settings_from_args(args).api_key == "from-the-secret"
    (app,) = yaml.safe_load(yaml.safe_load(RAYSERVICE.read_text())["spec"]["serveConfigV2"])["applications"]
    spec = replica_spec_from_args(parse_serve_argv(args_to_argv(app["args"])), cache_config=None)
    assert spec.settings.api_key == "from-the-secret"


def test_image_matches_the_ray_pin():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    assert base.startswith(f"rayproject/ray:{_ray_pin()}-")
    install = next(line for line in dockerfile.splitlines() if line.startswith("RUN pip install"))
    assert any(part.endswith("[ray]") for part in shlex.split(install))


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep")
def test_ray_worker_prestop_returns_once_no_replica_runs(tmp_path):
    """The worker's preStop hook waits while a Serve replica process runs on the pod, and returns at once when none
    does (its own shell, whose command line holds the pattern, must not count). `ray` is a stub here."""
    if subprocess.run(["pgrep", "-f", "ray::ServeReplica"], capture_output=True).returncode == 0:
        pytest.skip("a Ray Serve replica runs on this machine")
    cluster = yaml.safe_load(RAYSERVICE.read_text())["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    hook = worker["lifecycle"]["preStop"]["exec"]["command"]
    stub = tmp_path / "ray"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": "pod-0"}
    started = time.monotonic()
    assert subprocess.run(hook, env=env, timeout=20).returncode == 0
    assert time.monotonic() - started < 10
    replica = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3)", "ray::ServeReplica:dicache:DicacheServer"]
    )
    try:
        started = time.monotonic()
        assert subprocess.run(hook, env=env, timeout=20).returncode == 0
        assert time.monotonic() - started >= 2  # it waited for the replica to stop
    finally:
        replica.kill()
        replica.wait()


# ---------------------------------------------------------------------------------------------- compile artifacts
KEY_OPTIONS = ("ModelChoice", "DeviceOptions", "SpeedOptions", "TextEncoderOptions")


def _key_options(args) -> dict:
    """The option values that decide a compile artifact's key (the model, how it is loaded, quantised and compiled,
    the default size it warms up at)."""
    from dicache.commands.fields import values_from_args
    from dicache.models import options
    from dicache.server.settings import ServerProcessOptions

    values = {name: values_from_args(args, getattr(options, name)) for name in KEY_OPTIONS}
    values["default_size"] = values_from_args(args, ServerProcessOptions, only=("default_size",))
    return values


def _warmup_args(container: dict):
    import argparse

    from dicache.commands import warmup

    assert container["command"][:2] == ["dicache", "warmup"]
    parser = argparse.ArgumentParser(prog="dicache warmup", allow_abbrev=False)
    warmup.add_arguments(parser)
    return parser.parse_args(container["command"][2:])


def _mount(pod_spec: dict, container: dict, path: str) -> tuple[dict, dict]:
    """The volume mount at `path` and its volume."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def test_the_warmup_job_writes_the_artifact_the_serving_pods_load():
    claim = _kind(_docs(ARTIFACTS), "PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # written by the Job, read by pods on every node
    job = _kind(_docs(ARTIFACTS), "Job")["spec"]["template"]
    (writer,) = job["spec"]["containers"]
    deployment = _kind(_docs(SERVER), "Deployment")["spec"]["template"]
    (server,) = deployment["spec"]["containers"]
    served, warmed = parse_serve_argv(server["command"][2:]), _warmup_args(writer)
    assert _key_options(warmed) == _key_options(served)  # the same key: the same model, quantization, compile
    assert served.compile and served.compile_artifact
    assert writer["image"] == server["image"]
    assert job["spec"]["nodeSelector"] == deployment["spec"]["nodeSelector"]  # the same GPU type
    assert int(writer["resources"]["limits"]["nvidia.com/gpu"]) == 1

    mount, volume = _mount(job["spec"], writer, warmed.compile_artifact)
    assert (
        not mount.get("readOnly", False) and volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    )
    mount, volume = _mount(deployment["spec"], server, served.compile_artifact)
    assert mount["readOnly"] and volume["persistentVolumeClaim"]["readOnly"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    _assert_compile_cache_on_a_writable_volume(job["spec"], writer)  # the artifact is unpacked there


def test_the_ray_replicas_load_the_artifact_of_their_own_warmup_job():
    rayservice = yaml.safe_load(RAYSERVICE.read_text())
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    replica_args = parse_serve_argv(args_to_argv(app["args"]))
    spec, _ = replica_from_options(app["args"])
    assert spec.compile and spec.compile_artifact == replica_args.compile_artifact
    job = _kind(_docs(RAY_WARMUP), "Job")["spec"]["template"]
    (writer,) = job["spec"]["containers"]
    warmed = _warmup_args(writer)
    assert _key_options(warmed) == _key_options(replica_args)
    assert warmed.text_encoder_quantization == spec.text_encoder_quantization == "fp8"  # as the single-process pods
    claim = _kind(_docs(ARTIFACTS), "PersistentVolumeClaim")["metadata"]["name"]
    mount, volume = _mount(job["spec"], writer, warmed.compile_artifact)
    assert not mount.get("readOnly", False) and volume["persistentVolumeClaim"]["claimName"] == claim
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod_spec = group["template"]["spec"]
    (worker,) = pod_spec["containers"]
    assert worker["image"] == writer["image"] and pod_spec["nodeSelector"] == job["spec"]["nodeSelector"]
    mount, volume = _mount(pod_spec, worker, spec.compile_artifact)
    assert mount["readOnly"] and volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
