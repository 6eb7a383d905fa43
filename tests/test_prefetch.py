"""Weights read into the page cache while the process imports (`dicache.models.prefetch`, `--prefetch-weights`): what
a command line asks for, which files (the checkpoint's, or the quantised snapshot of this very checkpoint, after the
code files an earlier start listed: `startup_files`), every byte read once, nothing of torch imported, and the command
line's entry starting it before the commands' parser exists."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import pytest

from dicache.models import prefetch, startup_files
from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT, EMBEDDED_TURBO_CHECKPOINT
from dicache.models.options import ModelChoice, SpeedOptions
from dicache.models.prefetch import Prefetch, argv_request, files_to_prefetch
from dicache.models.store_layout import ARTIFACT_ENV, MANIFEST, PREFIX, checkpoint_fingerprint

MODEL = str(EMBEDDED_CHECKPOINT)


def test_the_flags_read_early_are_the_declared_ones():
    fields = {**ModelChoice.model_fields, **SpeedOptions.model_fields}
    for name, flag in prefetch.PREFETCH_FLAGS.items():
        assert fields[name].json_schema_extra["flag"] == flag, name


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "--model", MODEL], {"model": MODEL, "store": None}),
        (
            ["generate", "a fox", "--model", MODEL, "--compile", "--compile-artifact", "/a"],
            {"model": MODEL, "store": "/a"},
        ),
        (["warmup", "--model", MODEL, "--compile-artifact", "/a"], {"model": MODEL, "store": "/a"}),  # compiles
        (["serve", "--model", MODEL, "--compile-artifact", "/a"], {"model": MODEL, "store": None}),  # no --compile
        (["serve", "--model", MODEL, "--prefetch-weights", "false"], None),
        (["serve", "--model", MODEL, "--prefetch-weights"], {"model": MODEL, "store": None}),
        (["serve", "--model", MODEL, "--load-format", "dummy"], None),
        (["serve", "--load-format", "dummy", "--compile", "--compile-artifact", "/a"], {"model": None, "store": "/a"}),
        (["serve", "--compile", "--compile-artifact", "/a"], {"model": None, "store": "/a"}),  # its code files only
        (["serve", "--model", "krea/krea-2"], None),  # a hub id: nothing local to read
        (["serve"], None),  # the embedded checkpoint: the command knows it, the prefetch does not need to
        (["sweep", "--model", MODEL], None),
        (["serve", "--model", MODEL, "--help"], None),
    ],
)
def test_what_a_command_line_asks_for(argv, expected, monkeypatch):
    monkeypatch.delenv(ARTIFACT_ENV, raising=False)
    assert argv_request(argv) == expected


def test_the_store_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(ARTIFACT_ENV, "/artifacts")
    assert argv_request(["serve", "--model", MODEL, "--compile"]) == {"model": MODEL, "store": "/artifacts"}


def test_a_partial_checkpoint_reads_its_own_transformer_and_its_base_for_the_rest():
    files = files_to_prefetch(EMBEDDED_TURBO_CHECKPOINT)
    assert files[0].parent == EMBEDDED_TURBO_CHECKPOINT / "transformer"
    assert [f.parent.name for f in files] == ["transformer", "text_encoder", "vae"]
    assert {f.parent.parent.resolve() for f in files[1:]} == {EMBEDDED_CHECKPOINT.resolve()}


def _snapshot(store: pathlib.Path, name: str, checkpoint: dict, component: str = "transformer") -> pathlib.Path:
    folder = store / f"{PREFIX}{name}"
    folder.mkdir(parents=True)
    (folder / "shard-00001.safetensors").write_bytes(b"x" * 100)
    manifest = {"key": {"component": component, "checkpoint": json.dumps(checkpoint, sort_keys=True)}}
    (folder / MANIFEST).write_text(json.dumps({**manifest, "shards": {"shard-00001.safetensors": {}}}))
    return folder


def test_a_snapshot_of_this_checkpoint_is_read_instead_of_its_checkpoint_files(tmp_path):
    ours = checkpoint_fingerprint(EMBEDDED_CHECKPOINT / "transformer")
    other = {name: {**entry, "sha256": "0" * 64} for name, entry in ours.items()}
    _snapshot(tmp_path, "other", other)
    assert files_to_prefetch(EMBEDDED_CHECKPOINT, tmp_path)[0].parent.name == "transformer"  # another checkpoint's
    folder = _snapshot(tmp_path, "ours", ours)
    files = files_to_prefetch(EMBEDDED_CHECKPOINT, tmp_path)
    assert files[0] == folder / "shard-00001.safetensors"
    assert [f.parent.name for f in files[1:]] == ["text_encoder", "vae"]
    encoder = _snapshot(
        tmp_path, "encoder", checkpoint_fingerprint(EMBEDDED_CHECKPOINT / "text_encoder"), "text_encoder"
    )
    files = files_to_prefetch(EMBEDDED_CHECKPOINT, tmp_path)
    assert files[:2] == [folder / "shard-00001.safetensors", encoder / "shard-00001.safetensors"]
    assert [f.parent.name for f in files[2:]] == ["vae"]


def test_every_byte_is_read_once_and_an_unreadable_file_is_counted(tmp_path):
    files = files_to_prefetch(EMBEDDED_CHECKPOINT)
    missing = tmp_path / "gone.safetensors"
    run = Prefetch([*files, missing], threads=2).start()
    assert run.wait(60)
    report = run.report()
    assert report["GB"] == round(sum(f.stat().st_size for f in files) / 1e9, 3)
    assert report["unreadable"] == 1 and report["files"] == len(files) + 1 and report["done"]


def test_it_starts_without_importing_torch():
    code = (
        "import sys; from dicache.models.prefetch import start_prefetch; "
        f"run = start_prefetch(['serve', '--model', {MODEL!r}]); run.wait(60); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(run.report()['GB'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout) > 0


def test_the_command_line_starts_it_before_building_the_commands_parser(monkeypatch, tmp_path):
    from dicache import cli

    model = tmp_path / "krea2"
    shutil.copytree(EMBEDDED_CHECKPOINT, model)
    seen = []

    def parser_that_records():
        seen.append(prefetch.current())
        raise SystemExit(0)

    monkeypatch.setattr(cli, "build_parser", parser_that_records)
    monkeypatch.setattr(prefetch, "_current", None)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", str(model)])
    (running,) = seen
    assert running is not None and running.files == files_to_prefetch(model)
    assert running.wait(60)


def test_no_more_is_read_than_half_the_available_memory_holds(monkeypatch, tmp_path):
    files = files_to_prefetch(EMBEDDED_CHECKPOINT)
    sizes = [f.stat().st_size for f in files]
    assert prefetch.within(files, None) == files
    assert prefetch.within(files, sizes[0] + sizes[1]) == files[:2]  # the load's first files first
    assert prefetch.within(files, sizes[0] - 1) == []
    assert prefetch.available_memory() is None or prefetch.available_memory() > 0  # this machine's, read
    monkeypatch.setattr(prefetch, "available_memory", lambda: 2 * sizes[0])  # room for the transformer only
    monkeypatch.setattr(prefetch, "_current", None)
    run = prefetch.start_prefetch(["serve", "--model", MODEL])
    assert run.files == files[:1] and run.wait(60)


# ---------------------------------------------------------------------------------------------- start-up files
@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A store and the outcome of a fresh process (torch imported) recording its start-up files there."""
    store = tmp_path_factory.mktemp("store")
    code = (
        "import json, sys, torch; from dicache.models import startup_files; "
        f"print(json.dumps(startup_files.record({str(store)!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return store, json.loads(out.stdout.splitlines()[-1])


def test_a_start_lists_the_libraries_it_mapped_and_the_modules_it_read(recorded):
    import torch

    store, saved = recorded
    listing = json.loads(pathlib.Path(saved["path"]).read_text())
    assert saved["status"] == "saved" and saved["path"] == str(startup_files.listing_path(store))
    files = listing["files"]
    assert len(files) == len(set(files)) == saved["files"]
    assert listing["file_bytes"] == sum(pathlib.Path(f).stat().st_size for f in files)
    ranges = listing["ranges"]  # what of each library the process touched: the next start reads those bytes
    sizes = {f: pathlib.Path(f).stat().st_size for f in files}
    assert listing["bytes"] == sum(sum(n for _, n in ranges[f]) if f in ranges else sizes[f] for f in files)
    assert set(ranges) <= set(files) and all(startup_files._SHARED_LIBRARY.search(f) for f in ranges)
    for path, spans in ranges.items():
        ends = [offset + length for offset, length in spans]
        assert all(later - end >= startup_files.MERGE_GAP for end, (later, _) in zip(ends, spans[1:]))
        assert spans[0][0] >= 0 and ends[-1] <= sizes[path] + 4095  # the last page may run past the file's end
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    core = str(torch_lib / "libtorch_cpu.so")
    assert 0 < sum(n for _, n in ranges[core]) < sizes[core] / 2  # importing torch touches a fraction of it
    first_code = next(i for i, f in enumerate(files) if not startup_files._SHARED_LIBRARY.search(f))
    assert str(torch_lib / "libtorch_cpu.so") in files[:first_code]  # the libraries first: the bulk of the bytes
    modules = [pathlib.Path(f) for f in files[first_code:]]
    ours = pathlib.Path(
        startup_files.__cached__ if pathlib.Path(startup_files.__cached__).is_file() else startup_files.__file__
    )
    assert ours in modules  # each module's file as imported: its .pyc, or its source without one
    assert not [f for f in files if f.endswith(".safetensors")]  # weights are the prefetch's other part

    again = startup_files.record(store)  # one listing per installation: an existing one is kept
    assert again == {"status": "kept", "path": saved["path"]}
    assert json.loads(pathlib.Path(saved["path"]).read_text()) == listing


def test_a_later_start_answers_packages_distributions_from_the_listing(tmp_path, monkeypatch):
    """The listing keeps `importlib.metadata.packages_distributions()` as the recording process computed it, with the
    `sys.path` it searched; a later start of this installation answers the call from it while its `sys.path` is the
    same (the metadata is not read: transformers' import asks for it), a fresh copy each time, and computes it as
    before on another `sys.path`; a store without it changes nothing."""
    import importlib.metadata

    store = tmp_path / "store"
    computed = importlib.metadata.packages_distributions
    monkeypatch.setattr(importlib.metadata, "packages_distributions", computed)  # restored after the test
    assert startup_files.record(store)["status"] == "saved"
    expected = computed()
    assert startup_files.use_known_distributions(None) is False
    assert startup_files.use_known_distributions(tmp_path / "elsewhere") is False
    assert importlib.metadata.packages_distributions is computed

    assert startup_files.use_known_distributions(store) is True
    reads = []
    real_distributions = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: reads.append(1) or real_distributions(**kw))
    answer = importlib.metadata.packages_distributions()
    assert answer == expected and "torch" in answer and reads == []
    answer["torch"].append("changed")
    assert importlib.metadata.packages_distributions() == expected and reads == []  # a fresh copy per call
    assert importlib.metadata.packages_distributions.computed is computed

    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])  # another search path: computed as before
    assert importlib.metadata.packages_distributions() == computed() and reads


def test_the_command_lines_entry_answers_packages_distributions_from_the_store(recorded, monkeypatch):
    import importlib.metadata

    from dicache import cli

    store, _ = recorded
    computed = importlib.metadata.packages_distributions
    monkeypatch.setattr(importlib.metadata, "packages_distributions", computed)
    monkeypatch.setattr(cli, "start_prefetch", lambda argv: None)
    parsed = type("Args", (), {"run": None})()
    monkeypatch.setattr(
        cli, "build_parser", lambda: type("P", (), {"parse_args": lambda self, a: parsed, "print_help": print})()
    )
    cli.main(["serve", "--compile-artifact", str(store)])  # without --compile no store is used: nothing changes
    assert importlib.metadata.packages_distributions is computed
    cli.main(["serve", "--compile", "--compile-artifact", str(store)])
    assert importlib.metadata.packages_distributions.computed is computed


def test_the_listed_files_are_read_first_and_those_gone_are_skipped(tmp_path):
    store = tmp_path / "store"
    code = tmp_path / "libexample.so.1"
    code.write_bytes(b"\x7fELF" + b"0" * 1000)
    startup_files.listing_path(store).parent.mkdir(parents=True)
    listing = {"files": [str(code), str(tmp_path / "gone.so")]}
    startup_files.listing_path(store).write_text(json.dumps(listing))
    assert startup_files.listed_files(store) == [code]
    assert files_to_prefetch(EMBEDDED_CHECKPOINT, store) == [code, *files_to_prefetch(EMBEDDED_CHECKPOINT)]
    assert files_to_prefetch(None, store) == [code]  # random weights or a hub id: the code files alone
    startup_files.listing_path(store).write_text("{not json")
    assert startup_files.listed_files(store) == [] and startup_files.listed_files(None) == []


def test_the_command_line_reads_the_listed_code_then_the_weights(monkeypatch, recorded):
    store, saved = recorded
    monkeypatch.setattr(prefetch, "_current", None)
    run = prefetch.start_prefetch(["serve", "--model", MODEL, "--compile", "--compile-artifact", str(store)])
    assert run.wait(120)
    report = run.report()
    assert report["startup_files"] == saved["files"] and report["unreadable"] == 0
    weights = files_to_prefetch(EMBEDDED_CHECKPOINT)
    assert report["files"] == saved["files"] + len(weights)
    assert report["startup_GB"] == saved["GB"]  # the code handed to the kernel's read-ahead: the touched ranges
    assert report["GB"] == round(sum(f.stat().st_size for f in weights) / 1e9, 3)  # the weights read through


def test_a_read_only_store_is_one_line_and_no_listing(caplog):
    store = pathlib.Path("/sys/dicache-startup-files")  # sysfs: read-only even for root
    caplog.set_level("INFO", "dicache.models.startup_files")
    assert startup_files.record(store)["status"] == "unwritable"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dicache.models.startup_files"]
    assert line.startswith("start-up files: cannot write /sys/dicache-startup-files/startup-files-")


def test_another_installation_has_its_own_listing(monkeypatch, tmp_path):
    here = startup_files.listing_path(tmp_path)
    assert (
        here.parent == tmp_path
        and here.name.startswith(startup_files.PREFIX)
        and here == startup_files.listing_path(tmp_path)
    )
    packages = tmp_path / "site"  # a new image: one more package, then another version of it
    (packages / "newpackage-1.0.dist-info").mkdir(parents=True)
    folders = startup_files.installation_folders()
    monkeypatch.setattr(startup_files, "installation_folders", lambda: [*folders, str(packages)])
    with_one_more = startup_files.listing_path(tmp_path)
    (packages / "newpackage-1.0.dist-info").rename(packages / "newpackage-1.1.dist-info")
    assert len({here, with_one_more, startup_files.listing_path(tmp_path)}) == 3
    assert startup_files.installed_distributions()[-1] == "newpackage-1.1.dist-info"
    monkeypatch.setattr(startup_files, "installation_folders", lambda: [str(packages), str(tmp_path / "gone")])
    assert startup_files.installed_distributions() == ["newpackage-1.1.dist-info"]  # a folder gone is skipped


def test_every_process_of_one_installation_has_the_same_listing(tmp_path):
    """The key does not follow a process's `sys.path` or working directory: a child with another folder of package
    metadata on its path, run from a folder holding more (a source checkout's `.egg-info`), finds this (test runner)
    process's listing."""
    (tmp_path / "checkout.egg-info").mkdir()
    (tmp_path / "extra" / "extra-1.0.dist-info").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "extra"), os.environ.get("PYTHONPATH", "")])}
    code = "from dicache.models import startup_files; print(startup_files.listing_path('store'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, check=True
    )
    assert out.stdout.strip() == str(startup_files.listing_path("store"))


def test_libraries_are_listed_once_each_in_the_order_they_were_mapped(tmp_path):
    maps = tmp_path / "maps"  # Linux maps each new library below the last: the first loaded is the highest
    maps.write_text(
        "55d0a000-55d0b000 r--p 00000000 fe:00 1  /usr/bin/python3.11\n"
        "7f0000a00000-7f0000b00000 r-xp 00000000 fe:00 2  /lib/libsecond.so.2\n"
        "7f0000c00000-7f0000d00000 r--p 00000000 fe:00 3  /site/torch/lib/libfirst.so\n"
        "7f0000d00000-7f0000e00000 r-xp 00100000 fe:00 3  /site/torch/lib/libfirst.so\n"
        "7f0000e00000-7f0000e10000 r--s 00000000 fe:00 4  /models/transformer/shard.safetensors\n"
        "7f0000f00000-7f0000f01000 rw-p 00000000 00:00 0  [stack]\n"
        "7f0000f10000-7f0000f11000 r--p 00000000 fe:00 5  /tmp/x/libgone.so (deleted)\n"
    )
    assert startup_files.mapped_libraries(maps) == ["/site/torch/lib/libfirst.so", "/lib/libsecond.so.2"]
    assert startup_files.mapped_libraries(tmp_path / "absent") == []


def test_the_touched_ranges_of_a_library_come_from_its_present_pages(tmp_path):
    page = os.sysconf("SC_PAGE_SIZE")
    maps = tmp_path / "maps"
    maps.write_text(
        f"10000000-{0x10000000 + 256 * page:x} r-xp {2 * page:08x} fe:00 2  /lib/liba.so.1\n"
        f"20000000-{0x20000000 + 4 * page:x} r--p 00000000 fe:00 3  /lib/libb.so\n"
        f"30000000-{0x30000000 + 4 * page:x} r--p 00000000 fe:00 4  /usr/bin/python3\n"
    )
    pagemap = tmp_path / "pagemap"
    present = 1 << 63
    with open(pagemap, "wb") as fh:
        for base in (0x10000000, 0x20000000, 0x30000000):
            first = base // page
            fh.seek(first * 8)
            fh.write(struct.pack("<256Q", *[0] * 256))
        for index in (0, 1, 3, 150):  # liba's pages in memory; libb's none; python's all, but not a library
            fh.seek((0x10000000 // page + index) * 8)
            fh.write(struct.pack("<Q", present | 12345))
        fh.seek(0x30000000 // page * 8)
        fh.write(struct.pack("<4Q", *[present] * 4))
    ranges = startup_files.touched_ranges(maps, pagemap)
    # file pages 2, 3, 5 (one page apart: one read) and 152 (far: its own)
    assert ranges == {"/lib/liba.so.1": [[2 * page, 4 * page], [152 * page, page]]}
    assert startup_files.touched_ranges(tmp_path / "absent", pagemap) == {}


def test_the_listed_ranges_are_read_ahead_instead_of_the_whole_library(tmp_path, monkeypatch):
    store = tmp_path / "store"
    library, module = tmp_path / "libexample.so.1", tmp_path / "module.pyc"
    library.write_bytes(b"\x7fELF" + b"0" * 100_000)
    module.write_bytes(b"0" * 3000)
    startup_files.listing_path(store).parent.mkdir(parents=True)
    listing = {"files": [str(library), str(module)], "ranges": {str(library): [[0, 8192], [65536, 4096]]}}
    startup_files.listing_path(store).write_text(json.dumps(listing))
    assert startup_files.listed_ranges(store) == {str(library): [(0, 8192), (65536, 4096)]}
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append((offset, length)))
    ranges = startup_files.listed_ranges(store)
    run = Prefetch(startup_files.listed_files(store), threads=1, read_ahead=2, ranges=ranges)
    assert run.start().wait(30)
    assert advised == [(0, 8192), (65536, 4096), (0, 0)]  # the library's ranges, then the module whole
    assert run.report()["startup_GB"] == round((8192 + 4096 + 3000) / 1e9, 3)
    startup_files.listing_path(store).write_text(json.dumps({"files": [str(library)]}))
    assert startup_files.listed_ranges(store) == {} and startup_files.listed_ranges(None) == {}
