"""The small-GPU offload benchmark's logic mode (`--tiny --device cpu`): rows, exactness and byte accounting."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_offload  # noqa: E402


def test_tiny_logic_mode_streams_fewer_bytes_with_more_resident_blocks_and_with_the_cache(tmp_path, capsys):
    out, results = tmp_path / "bench.json", tmp_path / "RESULTS.md"
    argv = ["--tiny", "--device", "cpu", "--workloads", "raw", "--caches", "off,curved0.4", "--group-caches", "off"]
    argv += ["--runs", "resident,ours,group", "--out", str(out), "--results", str(results)]
    assert bench_offload.main(argv) == 0
    data = json.loads(out.read_text())
    rows = {(r["setting"], r["cache"]): r for r in data["rows"]}
    assert set(rows) == {
        (setting, cache) for setting in ("resident", "ours@1", "ours@3") for cache in ("off", "curved0.4")
    } | {("diffusers-group@1", "off")}
    assert data["plans"]["ours@1"]["streamed"] == [1, 2, 3, 4, 5] and data["plans"]["ours@3"]["resident"] == 3
    for setting in ("ours@1", "ours@3"):
        off, curved = rows[(setting, "off")], rows[(setting, "curved0.4")]
        assert off["bitwise_equal"] and curved["bitwise_equal"]
        assert off["computed_calls"] == 6 and curved["computed_calls"] == 2
        assert 0 < curved["bytes_per_image"] < off["bytes_per_image"]  # skipped steps copy nothing
        assert off["model_25GBps_s"] > 0
    assert rows[("ours@3", "off")]["bytes_per_image"] < rows[("ours@1", "off")]["bytes_per_image"]
    group = rows[("diffusers-group@1", "off")]
    assert group["computed_calls"] == 12 and group["bytes_per_image"] > rows[("ours@1", "off")]["bytes_per_image"]
    (archived,) = (tmp_path / "results" / "archive").glob("*-bench_offload.md")  # publish.py: one file per run
    text = archived.read_text()
    assert "cache-aware layerwise offload" in text and "| ours@1 | raw6 | off |" in text
    assert f"(results/archive/{archived.name})" in results.read_text()  # and its line in the run log
