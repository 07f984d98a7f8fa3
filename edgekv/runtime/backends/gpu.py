"""Device memory for the KV cache, following the KVMemory protocol (edgekv/runtime/memory.py).

- `OrtValueMemory` (ort-cuda): onnxruntime OrtValues on the GPU, no extra library;
  `OrtValueHeadMajorMemory`, the same in the fused graph's head-major shape.
- `CudaMemory` (trt): cuda-python's runtime API (cudaMalloc / cudaMemcpy).

Each buffer is allocated once, zero-filled, for the whole capacity; backends bind slot ranges by
address (base + slot * row bytes). Imports are lazy: this module loads without a GPU."""
from __future__ import annotations

import numpy as np

from edgekv.errors import BackendUnavailable, EdgeKVError
from edgekv.runtime.memory import SlotMemory, write_slots_by_runs


class OrtValueMemory:
    """KV buffers as onnxruntime OrtValues: on the GPU for ort-cuda (device "cuda"); with device
    "cpu" the same code runs in CI."""

    layout = "slots"  # cache.ptr's slot arithmetic holds (the graph as written)
    slots = 1

    def __init__(self, ort, device: str = "cuda"):
        self.ort, self.device = ort, device

    def free_bytes(self) -> int | None:
        try:
            return CudaMemory().free_bytes()
        except EdgeKVError:  # without cuda-python, onnxruntime reports out-of-memory itself
            return None

    def alloc(self, shape: tuple, dtype):
        zeros = np.zeros(shape, dtype)
        ov = self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), zeros.dtype.type, self.device, 0)
        ov.update_inplace(zeros)
        return ov

    def ptr(self, buf) -> int:
        return buf.data_ptr()

    @staticmethod
    def shape(buf) -> list[int]:
        """The buffer's whole shape (a binding of the whole buffer: the fused graph's cache)."""
        return list(buf.shape())

    def read(self, buf, n: int) -> np.ndarray:
        return buf.numpy()[:n].copy()  # a whole-buffer copy (snapshots: /save)

    def write(self, buf, arr: np.ndarray) -> None:
        full = buf.numpy()
        full[: len(arr)] = arr
        buf.update_inplace(full)

    def move_rows(self, buf, src: np.ndarray, dst: np.ndarray) -> None:
        """Compaction: the buffer to the host and back once (an OrtValue copies whole)."""
        full = buf.numpy()
        full[dst] = full[src]
        buf.update_inplace(full)


ITEM_BYTES = {"tensor(float16)": 2, "tensor(bfloat16)": 2, "tensor(float)": 4, "tensor(int8)": 1, "tensor(uint8)": 1}


class OrtValueHeadMajorMemory(OrtValueMemory):
    """ort-cuda's fused cache: one OrtValue per tensor, head-major [1, Hkv, slots + spare, D]
    (GroupQueryAttention's BNSH, as memory.HeadMajorMemory on the host), bound by address as both
    the op's past and present, so a call copies nothing of the cache (docs/fused.md, "ort-cuda").
    A moved call's new K/V go from the spare slots to their cells on the device (`copy_slots`);
    every other copy in or out speaks slots ([n, 1, Hkv, D]) through a whole-buffer host copy:
    snapshots, /save, undo, compaction, never a decode step."""

    layout = "heads"

    def __init__(self, ort, device: str = "cuda", spare: int = 0):
        super().__init__(ort, device)
        self.spare = spare

    def alloc(self, shape: tuple, dtype):
        if len(shape) != 4 or shape[1] != 1:
            raise ValueError(f"a head-major cache holds [slots, 1, Hkv, D] tensors, not {list(shape)}")
        slots, _, heads, dim = shape
        return super().alloc((1, heads, slots + self.spare, dim), dtype)

    def copy_slots(self, buf, src: int, dst: int, n: int) -> None:
        """Slots [src, src + n) to [dst, dst + n) in every head, in place on the buffer's device
        (the ranges must not overlap: a moved call's spare slots lie past the capacity). One
        strided copy: a row per head, the head's pitch apart."""
        _, heads, slots, dim = buf.shape()
        if not (0 <= src and src + n <= slots and 0 <= dst and dst + n <= slots) or abs(src - dst) < n:
            raise EdgeKVError(f"slots [{src}, {src + n}) -> [{dst}, {dst + n}) in a buffer of {slots}")
        row = dim * ITEM_BYTES[buf.data_type()]
        base = buf.data_ptr()
        try:
            copy_rows(self.device, base + dst * row, base + src * row, slots * row, n * row, heads)
        except BackendUnavailable:  # no cuda-python: the buffer through the host and back (slow, exact)
            full = buf.numpy()
            full[0, :, dst: dst + n] = full[0, :, src: src + n]
            buf.update_inplace(full)

    def read(self, buf, n: int) -> np.ndarray:
        return self.read_rows(buf, 0, n)

    def write(self, buf, arr: np.ndarray) -> None:
        self.write_rows(buf, 0, arr)

    def read_rows(self, buf, start: int, stop: int) -> np.ndarray:
        return buf.numpy()[0, :, start:stop].transpose(1, 0, 2)[:, None].copy()

    def write_rows(self, buf, start: int, arr: np.ndarray) -> None:
        full = buf.numpy()
        full[0, :, start: start + len(arr)] = arr[:, 0].transpose(1, 0, 2)
        buf.update_inplace(full)

    def write_slots(self, buf, slots: np.ndarray, arr: np.ndarray) -> None:
        write_slots_by_runs(self, buf, slots, arr)

    def move_rows(self, buf, src: np.ndarray, dst: np.ndarray) -> None:
        full = buf.numpy()
        full[0, :, dst] = full[0, :, src]  # the fancy index gathers every source first
        buf.update_inplace(full)


class OrtValueSlotMemory(OrtValueMemory):
    """serve's fused slots on ort-cuda: one OrtValue per tensor, [slots, Hkv, L, D] (memory.
    SlotMemory's layout, cell c at slot c // L's position c % L) on the memory's device. A call
    binds its consecutive slots by address (`block`); every copy in or out speaks cells, through a
    whole-buffer host copy and SlotMemory's own arithmetic (a prefix copied between slots,
    snapshots), never a decode step."""

    layout = SlotMemory.layout

    def __init__(self, ort, device: str, slots: int):
        super().__init__(ort, device)
        self.slots = slots
        self._cells = SlotMemory(slots)  # the cell arithmetic, applied to host copies

    def slot_length(self, capacity: int) -> int:
        return self._cells.slot_length(capacity)

    def alloc(self, shape: tuple, dtype):
        if len(shape) != 4 or shape[1] != 1:
            raise ValueError(f"a slotted cache holds [cells, 1, Hkv, D] tensors, not {list(shape)}")
        cells, _, heads, dim = shape
        return super().alloc((self.slots, heads, self.slot_length(cells), dim), dtype)

    def block(self, buf, first: int, count: int) -> tuple[int, list[int]]:
        """(address, shape) of slots [first, first + count): one contiguous block."""
        slots, heads, length, dim = buf.shape()
        if not 0 <= first <= first + count <= slots:
            raise EdgeKVError(f"slots [{first}, {first + count}) of {slots}")
        return buf.data_ptr() + first * heads * length * dim * ITEM_BYTES[buf.data_type()], [count, heads, length, dim]

    def read(self, buf, n: int) -> np.ndarray:
        return self._cells.read(buf.numpy(), n)

    def write(self, buf, arr: np.ndarray) -> None:
        self._through_host(buf, self._cells.write, arr)

    def read_rows(self, buf, start: int, stop: int) -> np.ndarray:
        return self._cells.read_rows(buf.numpy(), start, stop)

    def write_rows(self, buf, start: int, arr: np.ndarray) -> None:
        self._through_host(buf, self._cells.write_rows, start, arr)

    def write_slots(self, buf, slots: np.ndarray, arr: np.ndarray) -> None:
        write_slots_by_runs(self, buf, slots, arr)

    def move_rows(self, buf, src: np.ndarray, dst: np.ndarray) -> None:
        self._through_host(buf, self._cells.move_rows, src, dst)

    @staticmethod
    def _through_host(buf, change, *args) -> None:
        full = buf.numpy()
        change(full, *args)
        buf.update_inplace(full)


def copy_rows(device: str, dst: int, src: int, pitch: int, width: int, rows: int) -> None:
    """`rows` runs of `width` bytes, `pitch` apart, from src to dst on `device` (no overlap): host
    memory by memmove; CUDA by one cudaMemcpy2D device-to-device (cuda-python), then a device
    sync, since onnxruntime's next run goes on a stream of its own."""
    if device == "cpu":
        import ctypes

        for r in range(rows):
            ctypes.memmove(dst + r * pitch, src + r * pitch, width)
        return
    rt = cudart()
    check(rt.cudaMemcpy2D(dst, pitch, src, pitch, width, rows, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice))
    check(rt.cudaDeviceSynchronize())


def cudart():
    """cuda-python's runtime module (its import path moved in cuda-python 12.8)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise BackendUnavailable("the trt backend needs cuda-python: pip install cuda-python") from None
    return runtime


def check(result):
    """cuda-python returns (error, *values); raise on an error, return the value(s)."""
    err, *vals = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        if "MemoryAllocation" in name:
            raise EdgeKVError(f"CUDA: out of device memory ({name})", setting="capacity",
                              fix="use a smaller {} or close other programs")
        if "NoDevice" in name or "InsufficientDriver" in name:
            raise BackendUnavailable(f"CUDA: no usable GPU ({name})")
        raise EdgeKVError(f"CUDA error {name}")
    return vals[0] if len(vals) == 1 else (tuple(vals) or None)


class CudaBuffer:
    def __init__(self, ptr: int, shape: tuple, dtype):
        self.ptr, self.shape, self.dtype = int(ptr), tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self.row_bytes = self.nbytes // max(self.shape[0], 1)


class CudaMemory:
    device = "cuda"
    layout = "slots"
    slots = 1

    def __init__(self):
        self.cudart = cudart()
        self.buffers: list[CudaBuffer] = []

    def free_bytes(self) -> int:
        free, _total = check(self.cudart.cudaMemGetInfo())
        return int(free)

    def alloc(self, shape: tuple, dtype) -> CudaBuffer:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr = check(self.cudart.cudaMalloc(max(nbytes, 1)))
        check(self.cudart.cudaMemset(ptr, 0, max(nbytes, 1)))
        buf = CudaBuffer(ptr, shape, dtype)
        self.buffers.append(buf)
        return buf

    def ptr(self, buf: CudaBuffer) -> int:
        return buf.ptr

    def read(self, buf: CudaBuffer, n: int) -> np.ndarray:
        host = np.empty((n,) + buf.shape[1:], buf.dtype)
        if host.nbytes:
            check(self.cudart.cudaMemcpy(host.ctypes.data, buf.ptr, host.nbytes,
                                     self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return host

    def write(self, buf: CudaBuffer, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, buf.dtype)
        if arr.nbytes > buf.nbytes:
            raise EdgeKVError("write larger than the device buffer")
        if arr.nbytes:
            check(self.cudart.cudaMemcpy(buf.ptr, arr.ctypes.data, arr.nbytes,
                                     self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def read_rows(self, buf: CudaBuffer, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) to the host: a chat turn's undo, /save and /load copy only the
        cells they touch, not the whole cache."""
        if not 0 <= start <= stop <= buf.shape[0]:
            raise EdgeKVError(f"rows [{start}, {stop}) outside a buffer of {buf.shape[0]}")
        host = np.empty((stop - start,) + buf.shape[1:], buf.dtype)
        if host.nbytes:
            check(self.cudart.cudaMemcpy(host.ctypes.data, buf.ptr + start * buf.row_bytes, host.nbytes,
                                     self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return host

    def write_rows(self, buf: CudaBuffer, start: int, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, buf.dtype)
        if arr.shape[1:] != buf.shape[1:] or not 0 <= start <= start + len(arr) <= buf.shape[0]:
            raise EdgeKVError(f"rows [{start}, {start + len(arr)}) of shape {arr.shape[1:]} do not fit a buffer "
                              f"of {buf.shape}")
        if arr.nbytes:
            check(self.cudart.cudaMemcpy(buf.ptr + start * buf.row_bytes, arr.ctypes.data, arr.nbytes,
                                     self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def write_slots(self, buf, slots: np.ndarray, arr: np.ndarray) -> None:
        write_slots_by_runs(self, buf, slots, arr)

    def move_rows(self, buf: CudaBuffer, src: np.ndarray, dst: np.ndarray) -> None:
        """Compaction: the span of rows involved to the host and back, one copy each way (the
        cells of sequences decoded together interleave: a copy per run of cells would be a copy
        per cell). The span is often most of the pool: ~2 × the buffer per compaction."""
        lo, hi = int(min(src.min(), dst.min())), int(max(src.max(), dst.max())) + 1
        rows = self.read_rows(buf, lo, hi)
        rows[dst - lo] = rows[src - lo]
        self.write_rows(buf, lo, rows)

    def close(self) -> None:
        """Free every buffer this memory allocated (the trt backend's close calls it)."""
        for buf in self.buffers:
            self.cudart.cudaFree(buf.ptr)
        self.buffers.clear()
