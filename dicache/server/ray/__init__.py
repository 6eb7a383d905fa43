"""The `dicache serve` app on Ray Serve (the optional `dicache[ray]` extra): N replicas of the same OpenAI-compatible
server behind one endpoint.

Each replica is a Ray actor that loads its own pipeline (`ReplicaSpec.load_backend`) and serves the unchanged
single-process app, `create_app(backend, settings)`, through `serve.ingress`: endpoints, request validation, limits,
middleware and the error contract are the single-process server's. What Ray adds:

- replicas: a fixed count, or autoscaling between min and max on ongoing requests per replica (`RayServeOptions`);
- resources: `cpus_per_replica` and `gpus_per_replica` (fractions allowed: 0.5 puts two replicas on one GPU); a
  replica with `tp_size × ulysses_degree` > 1 holds one model over that many processes, one GPU each, through a
  STRICT_PACK placement group (`group`);
- routing: Serve's proxy sends a replica at most `workers + max_queue` requests at a time and holds up to
  `max_queue` more itself; its own failures (a replica that died mid-request, a full router queue, its timeout)
  are answered in the OpenAI error shape by `proxy.ServeErrorsMiddleware`;
- `X-Dicache-Replica: <replica id>` on every answer says which replica served it;
- `/metrics` is aggregated across replicas: one scrape returns every live replica's series, labelled
  `replica="<id>"` (`metrics`);
- health: Serve calls `check_health` every `--replica-health-period` s; a replica that does not answer within
  `--replica-health-timeout` s three times in a row, or whose model group lost a rank, is replaced;
- start-up on a busy node: Serve's HTTP proxy gets `--proxy-start-timeout` s to start and its health checks
  `--proxy-health-timeout` s (`startup.proxy_environment`: Serve's controller reads them from its environment), and
  `dicache serve --ray` waits `--replica-start-timeout` s for the replicas; a local cluster runs Ray's workers at
  the starting process's priority (`startup.local_cluster_environment`);
- drain: under `dicache serve --ray`, SIGTERM drains every replica through its app's own `Drain` (503 + Retry-After
  for new requests and `/health`, `--drain-timeout` for accepted generations) before the application is deleted
  (`drain`).

Modules, each with one job:

- `options`: the declared options (`RayServeOptions`, `ReplicaOptions`, `RayDriverOptions`), shared by the command
  line and the builder; `spec`: `ReplicaSpec`, what every replica loads;
- `resources`: what a replica reserves and whether the replicas fit a cluster; `group`: a replica split over
  tp × ulysses processes;
- `deployment`: the deployment's arguments, the replica actor and the application; `metrics` (with
  `server.metrics_merge`), `drain`, `proxy`: aggregated `/metrics`, the drain on SIGTERM, Serve's own errors;
- `startup`: the cluster's environment and the timed start of Serve and the replicas;
- entry points: `builder.app_builder` for `serve run` / `serve deploy` / KubeRay's `serveConfigV2` (its args are
  `dicache serve` options without the dashes, checked against their declarations, never parsed as argv), and
  `driver.serve_on_ray`, which `dicache serve --ray` (`dicache.commands.serve_ray`, where the argv is parsed) calls.

The earlier paths `dicache.server.ray_serve:app_builder` and `dicache.server.ray_proxy:proxy_middlewares` still name
the builder and the proxy callback. This package's `__init__` imports nothing, so that Serve's proxy, which imports
`proxy`, loads neither Ray nor torch nor the engine.
"""
