"""Fixtures shared by the test modules."""

import os

# MKL's float results may depend on buffer alignment; under concurrent requests the allocator hands out other
# addresses, so the bitwise-equality tests ask MKL for results independent of alignment (before torch loads MKL).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny models: faster and steadier on a small, busy CPU; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped elsewhere (run them on the GPU machine: `pytest -m gpu`)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_family_folders(tmp_path_factory):
    """Tiny Flux.1 and PixArt-Σ diffusers pipeline folders with text encoders (`family_folders`), built once."""
    pytest.importorskip("diffusers")
    import family_folders

    root = tmp_path_factory.mktemp("families")
    return {"flux": family_folders.flux_folder(root), "pixart": family_folders.pixart_folder(root)}
