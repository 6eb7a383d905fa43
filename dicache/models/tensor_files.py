"""Reading safetensors files at the disk's speed, straight onto the device.

`safetensors.safe_open(..., device="cuda")` reads each tensor through a memory map into a pageable host tensor and
copies that to the GPU, one tensor after the other, one file after the other: page faults and an unpinned copy per
tensor. Here (`read_tensor_files`):
- the files of a sharded checkpoint are read in parallel (one thread per file, up to `threads`), each from start to
  end in large sequential reads (`readinto`, no memory map);
- on a CUDA device the bytes land in a pinned staging buffer of the reading thread (two, alternating, so the next
  read overlaps the copy) and are copied into the tensor's own device memory: no host copy of the model, no device
  copy beside the tensor;
- on the CPU they are read straight into the tensor's memory.
Each tensor is handed over (`(key, tensor)`, in file order within each file, files interleaved) as soon as it is
complete, so that a caller can assemble and post-process (quantise) a model part by part while the rest is read.
The format is safetensors' (an 8-byte little-endian header length, a JSON header of `dtype` / `shape` /
`data_offsets` per key, then the data); `read_header` parses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors' dtype names -> torch dtypes."""

STAGING_BYTES = 64 << 20
"""Size of each pinned staging buffer (two per reading thread) for a CUDA device."""
MAX_HEADER_BYTES = 100 << 20


class TensorFileError(ValueError):
    """A file is not a readable safetensors file; the message names the file (and the key)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its key, dtype, shape and byte range in the file (from the start of the file)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: str | os.PathLike) -> list[TensorEntry]:
    """The tensors of a safetensors file in the order of their data. Raises `TensorFileError` for a file that is
    not one (truncated, bad header, unknown dtype, data outside the file) and OSError when it cannot be read."""
    file = pathlib.Path(file)
    size = file.stat().st_size
    with file.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise TensorFileError(f"{file} is not a safetensors file: {size} bytes, shorter than its header length")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise TensorFileError(f"{file} is not a safetensors file: header length {length} for {size} bytes")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TensorFileError(f"{file} is not a safetensors file: its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{file} is not a safetensors file: its header is not a JSON object")
    base = 8 + length
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise TensorFileError(f"{file}: tensor {key!r} has a bad header entry {info!r} ({err})") from None
        expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or begin < 0 or base + end > size:
            raise TensorFileError(
                f"{file}: tensor {key!r} ({info['dtype']} {list(shape)}) has data bytes {begin}..{end}, which do not "
                f"fit its shape ({expected} bytes) or the file ({size - base} data bytes): truncated or corrupt"
            )
        entries.append(TensorEntry(key, dtype, shape, base + begin, base + end))
    return sorted(entries, key=lambda e: e.start)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def read_tensor_files(
    files: Sequence[str | os.PathLike],
    device: torch.device | str = "cpu",
    cast: Callable[[str, torch.dtype], torch.dtype] | None = None,
    threads: int = 8,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files` as `(key, tensor on device)` (see the module docstring). `cast(key, stored dtype)`
    gives the dtype a tensor is wanted in (None: as stored); a conversion happens on the device after the read.
    Errors of any reading thread (OSError, `TensorFileError`) are raised here, naming the file."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the reading threads' current device is not this one's
        device = torch.device("cuda", torch.cuda.current_device())
    files = [pathlib.Path(f) for f in files]
    headers = {file: read_header(file) for file in files}  # every header checked before any data is read
    if not files:
        return
    done = object()
    results: queue.Queue = queue.Queue(maxsize=64)
    stop = threading.Event()

    def work(batch: list[pathlib.Path]) -> None:
        try:
            reader = _Reader(device)
            for file in batch:
                for key, tensor in reader.read(file, headers[file], stop):
                    results.put((key, tensor))
            reader.finish()
        except BaseException as exc:  # handed to the consumer, which raises it
            results.put(exc)
        finally:
            results.put(done)

    count = max(1, min(threads, len(files)))
    batches = [files[i::count] for i in range(count)]
    workers = [
        threading.Thread(target=work, args=(b,), name=f"dicache-read-{i}", daemon=True) for i, b in enumerate(batches)
    ]
    for worker in workers:
        worker.start()
    running = len(workers)
    try:
        while running:
            item = results.get()
            if item is done:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            key, tensor = item
            wanted = cast(key, tensor.dtype) if cast is not None else None
            if wanted is not None and wanted != tensor.dtype and tensor.is_floating_point():
                tensor = tensor.to(wanted)
            yield key, tensor
    finally:
        stop.set()
        while any(w.is_alive() for w in workers):  # unblock threads waiting on a full queue
            with contextlib.suppress(queue.Empty):
                results.get(timeout=0.05)
        for worker in workers:
            worker.join()


class _Reader:
    """One thread's reads: straight into CPU tensors, or through two pinned buffers into CUDA tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(device)  # this thread's copies and events on the tensors' device
            self.staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.copied = [None, None]  # the event after the last copy out of each buffer
            self.turn = 0

    def read(self, file: pathlib.Path, entries: list[TensorEntry], stop: threading.Event):
        with file.open("rb", buffering=0) as fh:
            position = 0
            for entry in entries:
                if stop.is_set():
                    return
                if entry.start != position:
                    fh.seek(entry.start)
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                target = tensor.view(-1).view(torch.uint8) if tensor.numel() else None
                if target is not None:
                    if self.cuda:
                        self._read_through_staging(fh, file, entry, target)
                    else:
                        _read_exactly(fh, memoryview(target.numpy()), file, entry)
                position = entry.end
                yield entry.key, tensor

    def _read_through_staging(self, fh, file: pathlib.Path, entry: TensorEntry, target: torch.Tensor) -> None:
        offset = 0
        while offset < entry.nbytes:
            size = min(STAGING_BYTES, entry.nbytes - offset)
            buffer, event = self.staging[self.turn], self.copied[self.turn]
            if event is not None:
                event.synchronize()  # the buffer's previous copy to the device is done
            _read_exactly(fh, memoryview(buffer.numpy())[:size], file, entry)
            target[offset : offset + size].copy_(buffer[:size], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.copied[self.turn] = event
            self.turn = 1 - self.turn
            offset += size

    def finish(self) -> None:
        """Wait for this thread's last copies (the staging buffers are freed with the reader)."""
        if self.cuda:
            for event in self.copied:
                if event is not None:
                    event.synchronize()


def _read_exactly(fh, view: memoryview, file: pathlib.Path, entry: TensorEntry) -> None:
    filled = 0
    while filled < len(view):
        got = fh.readinto(view[filled:])
        if not got:
            raise TensorFileError(f"{file} ended inside tensor {entry.key!r}: truncated")
        filled += got
