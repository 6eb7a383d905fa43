"""The soak of issue 45 (part 3) on the CPU: `benchmarks/bench_soak.py` against `dicache serve` on the embedded tiny
model, 2,000 requests at concurrency 8 (generations of mixed sizes, steps, CFG, image counts, formats and cache
settings; clients leaving during their generation or in the middle of their body; bad bodies). Nothing lost (the
server answered every request, each as expected, none with a 5xx), nothing leaked (the server's resident memory,
threads and open descriptors within 2 % of their level after the warm-up), latency stable (P99 of the last third of
the run at most twice that of the first: a looser bound than the benchmark's 1.5, for CPU runners shared with other
jobs). About 1.5 minutes on two dedicated cores."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_soak  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_a_soak_of_2000_requests_loses_and_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    argv = ["--tiny", "--device", "cpu", "--requests", "1700", "--warmup", "300", "--concurrency", "8"]
    argv += ["--p99-ratio", "2.0", "--out", str(out), "--results", str(tmp_path / "RESULTS.md")]
    code = bench_soak.main(argv)
    result = json.loads(out.read_text())
    assert result["requests"] == 2000 and min(result["kinds"].values()) >= 200, result["kinds"]
    failed = [row for row in result["checks"] + result["leaks"] if not row["ok"]]
    assert not failed and not result["problems"], (failed, result["problems"])
    assert result["latency"]["ok"], result["latency"]
    (run,) = (tmp_path / "results" / "archive").glob("*-bench_soak.md")  # publish: one archive file per run
    assert code == 0 and "**passed**" in run.read_text() and run.name in (tmp_path / "RESULTS.md").read_text()


@pytest.mark.parametrize(("mode", "num_blocks"), [("tiny", 10), ("full", 28)])
def test_every_request_of_the_mixture_is_the_kind_it_claims(mode, num_blocks):
    """Each generation of the mixture passes the server's validation for its model (so it must be answered 200),
    each bad body fails it (400): checked on the CPU before a GPU run depends on it."""
    from dicache.server.errors import ApiError
    from dicache.server.generation import Defaults, resolve
    from dicache.server.schemas import ImageGenerationRequest
    from dicache.server.settings import ServerSettings
    from dicache.settings.cache_config import CacheConfig

    defaults = Defaults("turbo", 8, 1.0, 1024, 1024, size_multiple=8 if mode == "tiny" else 16)
    for request in bench_soak.plan_requests(400, mode, seed=0):
        try:
            body = ImageGenerationRequest.model_validate_json(request.body)
            resolve(body, ServerSettings(), defaults, CacheConfig.defaults(), num_blocks)
            valid = request.content_type == "application/json"
        except (ValueError, ApiError):
            valid = False
        assert valid == (request.kind != "bad"), request
