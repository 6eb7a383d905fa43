"""The compile artifact (`dicache.models.compile_artifact`, docs/startup.md): a second process that loads it compiles
nothing (torch's own counters); a key mismatch, a corrupt or truncated artifact and a read-only store each give one
clear log line and a normal start."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest

from dicache.models.compile_artifact import DIGEST_CHARS, MANIFEST, PAYLOAD, ArtifactKey, load_artifact, save_artifact
from dicache.models.store_layout import ARTIFACT_ENV, PREFIX, artifact_store

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = ArtifactKey({"torch": "2.13.0", "gpu": "NVIDIA H200", "shapes": "[1024, 1024]"})
LOGGER = "dicache.models.compile_artifact"


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """This process's compile caches pointed at fresh folders (inductor's, and Triton's apart from it)."""
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    return inductor, triton


def _fill(inductor: pathlib.Path, triton: pathlib.Path) -> dict[str, bytes]:
    files = {
        "inductor/fxgraph/ab/fabc": b"graph" * 100,
        "inductor/ab/cabc.py": b"print('kernel')\n",
        "inductor/ab/cabc.so": os.urandom(4096),
        "triton/XYZ/kernel.cubin": os.urandom(2048),
    }
    for name, data in files.items():
        root = inductor if name.startswith("inductor/") else triton
        path = root / name.split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (inductor / "locks").mkdir()
    (inductor / "locks" / "x.lock").write_text("")
    return files


def _moved_caches(tmp_path, monkeypatch, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """Empty caches elsewhere: what a rescheduled pod has."""
    inductor, triton = tmp_path / name / "inductor", tmp_path / name / "triton"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    return inductor, triton


def _records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def test_the_store_comes_from_the_option_else_the_environment():
    assert artifact_store("/a/b", {ARTIFACT_ENV: "/c"}) == pathlib.Path("/a/b")
    assert artifact_store(None, {ARTIFACT_ENV: "/c"}) == pathlib.Path("/c")
    assert artifact_store(None, {ARTIFACT_ENV: " "}) is None
    assert artifact_store(None, {}) is None


def test_a_key_names_what_differs():
    other = {**KEY.fields, "gpu": "NVIDIA H100"}
    assert ArtifactKey(other).digest != KEY.digest
    assert ArtifactKey(dict(reversed(list(KEY.fields.items())))).digest == KEY.digest  # order does not matter
    assert KEY.differences(other) == ["gpu: NVIDIA H200 here, NVIDIA H100 in the artifact"]


def test_a_saved_artifact_fills_empty_caches_elsewhere_with_the_same_files(tmp_path, monkeypatch, caches, caplog):
    files = _fill(*caches)
    store = tmp_path / "store"
    caplog.set_level(logging.INFO, LOGGER)
    saved = save_artifact(store, KEY, {"warm_up_s": 12.5})
    assert saved.status == "saved" and saved.files == len(files)
    manifest = json.loads((store / KEY.digest[:DIGEST_CHARS] / MANIFEST).read_text())
    assert manifest["key"] == dict(KEY.fields) and manifest["notes"] == {"warm_up_s": 12.5}
    assert [r.getMessage() for r in _records(caplog)] == [f"compile artifact {store}: {saved.message}"]

    inductor, triton = _moved_caches(tmp_path, monkeypatch, "fresh")
    caplog.clear()
    loaded = load_artifact(store, KEY)
    assert loaded.status == "loaded" and loaded.files == len(files)
    assert len(_records(caplog)) == 1
    for name, data in files.items():
        root = inductor if name.startswith("inductor/") else triton
        assert (root / name.split("/", 1)[1]).read_bytes() == data
    assert not (inductor / "locks").exists()  # lock files are per process: never carried
    # loading again keeps what is there (a cache file's name is its content's hash)
    assert load_artifact(store, KEY).files == 0


def test_saving_again_replaces_the_artifact_of_the_same_key(tmp_path, caches):
    _fill(*caches)
    store = tmp_path / "store"
    save_artifact(store, KEY)
    (caches[0] / "new.py").write_text("x = 1\n")
    assert save_artifact(store, KEY).files == 5
    assert sorted(p.name for p in store.iterdir()) == [KEY.digest[:DIGEST_CHARS]]  # no staging folders left


def test_a_key_mismatch_is_one_line_naming_the_difference_and_nothing_is_loaded(tmp_path, monkeypatch, caches, caplog):
    _fill(*caches)
    store = tmp_path / "store"
    save_artifact(store, KEY)
    inductor, triton = _moved_caches(tmp_path, monkeypatch, "other-gpu")
    caplog.set_level(logging.INFO, LOGGER)
    outcome = load_artifact(store, ArtifactKey({**KEY.fields, "gpu": "NVIDIA H100"}))
    assert outcome.status == "mismatch"
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING
    assert "gpu: NVIDIA H100 here, NVIDIA H200 in the artifact" in record.getMessage()
    assert "compiling from scratch" in record.getMessage()
    assert not inductor.exists() or not any(inductor.rglob("*.so"))


def test_a_manifest_of_another_key_under_this_digest_is_a_mismatch(tmp_path, caches, caplog):
    _fill(*caches)
    store = tmp_path / "store"
    saved = save_artifact(store, KEY)
    manifest = pathlib.Path(saved.path) / MANIFEST
    data = json.loads(manifest.read_text())
    data["key"]["torch"] = "2.11.0"
    manifest.write_text(json.dumps(data))
    caplog.set_level(logging.INFO, LOGGER)
    assert load_artifact(store, KEY).status == "mismatch"
    (record,) = _records(caplog)
    assert "torch: 2.13.0 here, 2.11.0 in the artifact" in record.getMessage()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "no payload", "bad manifest"])
def test_a_corrupt_or_unreadable_artifact_is_one_line_and_loads_nothing(tmp_path, monkeypatch, caches, caplog, damage):
    _fill(*caches)
    store = tmp_path / "store"
    folder = pathlib.Path(save_artifact(store, KEY).path)
    payload = folder / PAYLOAD
    data = payload.read_bytes()
    if damage == "truncated":
        payload.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        payload.write_bytes(data[:600] + bytes([data[600] ^ 0xFF]) + data[601:])
    elif damage == "no payload":
        payload.unlink()
    else:
        (folder / MANIFEST).write_text("{not json")
    inductor, _ = _moved_caches(tmp_path, monkeypatch, "fresh")
    caplog.set_level(logging.INFO, LOGGER)
    outcome = load_artifact(store, KEY)
    assert outcome.status == "unreadable", outcome
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING and "compiling from scratch" in record.getMessage()
    assert str(store) in record.getMessage()
    assert not inductor.exists() or not any(p.is_file() for p in inductor.rglob("*"))


def test_a_read_only_store_is_one_line_when_saving(caches, caplog):
    _fill(*caches)
    store = pathlib.Path("/sys/dicache-compile-artifact")  # sysfs: read-only even for root
    if os.access("/sys", os.W_OK) and store.parent.is_dir():
        try:
            store.mkdir()
        except OSError:
            pass
        else:
            store.rmdir()
            pytest.skip("/sys is writable here")
    caplog.set_level(logging.INFO, LOGGER)
    outcome = save_artifact(store, KEY)
    assert outcome.status == "not_saved"
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING and "cannot write it" in record.getMessage()


def test_nothing_compiled_saves_nothing(tmp_path, caches, caplog):
    store = tmp_path / "store"
    caplog.set_level(logging.INFO, LOGGER)
    assert save_artifact(store, KEY).status == "empty"
    assert not any(store.iterdir())
    assert len(_records(caplog)) == 1


def test_an_empty_store_is_one_line_at_info(tmp_path, caches, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    assert load_artifact(tmp_path / "nothing-here", KEY).status == "absent"
    (record,) = _records(caplog)
    assert record.levelno == logging.INFO


def test_weight_snapshots_beside_the_artifacts_are_not_other_keys(tmp_path, caches, caplog):
    """A first start saves its quantised weights before its warm-up: the store then holds a snapshot's folder and
    manifest but no artifact, which is `absent` at INFO, not a mismatch naming the snapshot's key."""
    snapshot = tmp_path / "store" / f"{PREFIX}0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot / MANIFEST).write_text(json.dumps({"format": 1, "key": {"component": "transformer"}, "shards": {}}))
    caplog.set_level(logging.INFO, LOGGER)
    assert load_artifact(tmp_path / "store", KEY).status == "absent"
    (record,) = _records(caplog)
    assert record.levelno == logging.INFO and "none here yet" in record.getMessage()


# ---------------------------------------------------------------------------------------------- the start-up
class _Pipe:
    device = "cpu"

    def compile_key(self, shapes):
        return ArtifactKey({**KEY.fields, "shapes": json.dumps(shapes)})


class _Backend:
    """What `ready_to_serve` calls: its warm-up compiles (writes a cache file) unless the artifact was loaded."""

    def __init__(self, inductor: pathlib.Path) -> None:
        self.pipe, self.inductor, self.warmed = _Pipe(), inductor, 0

    def compile_key(self):
        return self.pipe.compile_key(self.warm_up_shapes())

    def warm_up_shapes(self):
        return {"size": [64, 64]}

    def warm_up(self):
        self.warmed += 1
        self.inductor.mkdir(parents=True, exist_ok=True)
        (self.inductor / "compiled.py").write_text("kernel = 1\n")
        return {"seconds": 1.0}

    def prepare_text_lengths(self, background=False, **preparation):
        return {}


def _start(store, inductor, caplog):
    from dicache.server.backend import ready_to_serve

    backend, lines = _Backend(inductor), []
    caplog.clear()
    ready_to_serve(backend, warm_up=True, prepare_text_lengths="off", report=lines.append, compile_artifact=store)
    return backend, [r for r in _records(caplog) if r.levelno >= logging.WARNING]


def test_the_server_start_up_compiles_and_serves_whatever_the_artifact(tmp_path, monkeypatch, caches, caplog):
    pytest.importorskip("fastapi")
    from dicache.server import backend as backend_module

    monkeypatch.setattr(backend_module, "freeze_start_up_objects", lambda: None)  # not this test process's objects
    caplog.set_level(logging.INFO, LOGGER)
    store = tmp_path / "store"
    backend, warnings = _start(store, caches[0], caplog)  # none yet: compiles, then saves
    assert backend.warmed == 1 and not warnings
    assert backend.startup["compile_artifact"]["status"] == "absent"
    assert backend.startup["compile_artifact_saved"]["status"] == "saved"
    listing = backend.startup["startup_files"]  # the code this start read, for the next start's prefetch
    assert listing["status"] == "saved" and listing["files"] > 0 and pathlib.Path(listing["path"]).parent == store

    inductor, _ = _moved_caches(tmp_path, monkeypatch, "second")
    backend, warnings = _start(store, inductor, caplog)
    assert backend.startup["compile_artifact"]["status"] == "loaded" and not warnings
    assert backend.startup["startup_files"] == {"status": "kept", "path": listing["path"]}
    assert "compile_artifact_saved" not in backend.startup  # nothing to save: it was loaded
    assert (inductor / "compiled.py").is_file()

    payload = next(store.glob(f"*/{PAYLOAD}"))
    payload.write_bytes(payload.read_bytes()[:100])  # truncated
    inductor, _ = _moved_caches(tmp_path, monkeypatch, "third")
    backend, warnings = _start(store, inductor, caplog)
    assert backend.warmed == 1 and len(warnings) == 1 and "truncated or corrupt" in warnings[0].getMessage()
    assert backend.startup["compile_artifact_saved"]["status"] == "saved"  # and a sound one replaces it

    read_only = pathlib.Path("/sys/dicache-compile-artifact")
    backend, warnings = _start(read_only, inductor, caplog)
    assert backend.warmed == 1 and backend.startup["compile_artifact"]["status"] == "absent"
    assert [w.getMessage().split(": ", 1)[1][:15] for w in warnings] == ["cannot write it"]
    assert backend.startup["startup_files"]["status"] == "unwritable"


# ---------------------------------------------------------------------------------------------- two processes
def _fresh_process(tmp_path: pathlib.Path, name: str, store: pathlib.Path, *extra: str) -> dict:
    """tests/artifact_worker.py in a new process with empty caches, temporary folder and home (a rescheduled pod)."""
    root = tmp_path / name
    for folder in ("home", "tmp"):
        (root / folder).mkdir(parents=True)
    env = {
        **os.environ,
        "HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no compile-worker pool to start on a 2-core runner
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop(ARTIFACT_ENV, None)
    out = root / "out.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "artifact_worker.py"), str(store), str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    record["log"] = [line for line in result.stderr.splitlines() if line.startswith(LOGGER)]
    return record


@pytest.mark.slow
def test_a_second_process_with_the_artifact_compiles_nothing(tmp_path):
    """The embedded model's blocks compiled on the CPU in one process; a fresh one (empty caches, tmp and home)
    loads the artifact and compiles its graph from cache hits only, with the same output."""
    store = tmp_path / "store"
    first = _fresh_process(tmp_path, "first", store)
    assert first["loaded"]["status"] == "absent" and first["saved"]["status"] == "saved"
    assert first["counters"]["graphs"] >= 1 and first["counters"]["fx_graph_cache_miss"] >= 1

    second = _fresh_process(tmp_path, "second", store)
    assert second["loaded"]["status"] == "loaded", second["log"]
    counters = second["counters"]
    assert counters["fx_graph_cache_miss"] == 0 and counters["aot_autograd_cache_miss"] == 0, counters
    assert counters["fx_graph_cache_hit"] == first["counters"]["fx_graph_cache_miss"], counters
    assert counters["aot_autograd_cache_hit"] == first["counters"]["aot_autograd_cache_miss"], counters
    assert second["checksum"] == first["checksum"]
    assert len(second["log"]) == 1 and "loaded" in second["log"][0]


@pytest.mark.gpu
def test_the_fp8_path_round_trips_on_the_gpu(tmp_path):
    """The same round trip with FP8 blocks (torchao's tensor subclasses) compiled on CUDA: the second process, its
    FP8 weights read from the weight snapshot the first one saved, compiles from cache hits only (Triton kernels and
    autotuning results came with the artifact) and gives the same output."""
    pytest.importorskip("torchao")
    store = tmp_path / "store"
    fp8 = ("--device", "cuda", "--quantization", "fp8", "--weight-store", str(store))
    first = _fresh_process(tmp_path, "first", store, *fp8)
    assert first["saved"]["status"] == "saved" and first["counters"]["fx_graph_cache_miss"] >= 1
    assert first["weight_snapshots"]["transformer_saved"]["status"] == "saved"
    second = _fresh_process(tmp_path, "second", store, *fp8)  # its FP8 weights read from the snapshot
    counters = second["counters"]
    assert second["weight_snapshots"]["transformer"]["status"] == "loaded", second["weight_snapshots"]
    assert second["loaded"]["status"] == "loaded", second["log"]
    assert counters["fx_graph_cache_miss"] == 0 and counters["fx_graph_cache_hit"] >= 1, counters
    assert counters["aot_autograd_cache_miss"] == 0, counters
    assert second["checksum"] == first["checksum"]
    print(json.dumps({"first": first, "second": second}, indent=1))  # what the GPU run's log keeps
