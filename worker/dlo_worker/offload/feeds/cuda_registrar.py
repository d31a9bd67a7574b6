"""The CUDA :class:`~dlo_worker.offload.feeds.registration.HostRegistrar`: ``cudaHostRegister``
with the read-only flag, through the CUDA runtime torch already loaded.

A file-backed shared mapping opened read-only can only be registered with
``cudaHostRegisterReadOnly`` (the default flag asks for write access and fails); the
device must report ``cudaDevAttrHostRegisterReadOnlySupported``, which some platforms
lack. A failed call leaves a sticky error in the runtime's per-thread state, which is
cleared here so torch's next call does not report it as its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch

from dlo_worker.offload.feeds.registration import PlatformRegistrationError

HOST_REGISTER_READ_ONLY = 0x08
"""``cudaHostRegisterReadOnly``."""
DEVICE_ATTR_HOST_REGISTER_READ_ONLY = 113
"""``cudaDevAttrHostRegisterReadOnlySupported``."""


MEMORY_TYPE_HOST = 1
"""``cudaMemoryTypeHost``: page-locked or registered host memory."""


class _PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes`` (CUDA 11 and later), with room for the fields later
    releases append (the runtime writes the whole structure of its own version)."""

    _fields_ = (
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),
    )


def loaded_cudart() -> ctypes.CDLL:
    """The CUDA runtime library this process already uses (torch loaded it), so the error
    state cleared here is torch's own."""
    torch.cuda.init()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.rsplit(" ", 1)[-1]
        if "libcudart.so" in Path(path).name:
            return ctypes.CDLL(path)
    found = ctypes.util.find_library("cudart")
    if found is None:
        raise OSError("the CUDA runtime library (libcudart) is not loaded")
    return ctypes.CDLL(found)


class CudaHostRegistrar:
    """Read-only host registration on one CUDA device."""

    name = "cudaHostRegister"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cudart = loaded_cudart()
        self._cudart.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._cudart.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._cudart.cudaGetErrorString.restype = ctypes.c_char_p
        self._cudart.cudaPointerGetAttributes.argtypes = [
            ctypes.POINTER(_PointerAttributes),
            ctypes.c_void_p,
        ]
        self._cudart.cudaDeviceGetAttribute.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.c_int,
        ]

    def unsupported_reason(self) -> str | None:
        value = ctypes.c_int(0)
        index = self.device.index if self.device.index is not None else 0
        status = self._cudart.cudaDeviceGetAttribute(
            ctypes.byref(value), DEVICE_ATTR_HOST_REGISTER_READ_ONLY, index
        )
        if status != 0:
            return f"cannot query read-only registration: {self._clear(status)}"
        if value.value == 0:
            return (
                f"{torch.cuda.get_device_name(index)} does not support read-only host "
                "registration (cudaDevAttrHostRegisterReadOnlySupported = 0)"
            )
        return None

    def register(self, start: int, nbytes: int) -> None:
        status = self._cudart.cudaHostRegister(start, nbytes, HOST_REGISTER_READ_ONLY)
        if status != 0:
            raise PlatformRegistrationError(self._clear(status))

    def unregister(self, start: int) -> None:
        status = self._cudart.cudaHostUnregister(start)
        if status != 0:
            raise PlatformRegistrationError(self._clear(status))

    def is_pinned(self, view: torch.Tensor) -> bool:
        """Whether the driver sees the view's first and last byte as page-locked host memory
        (``Tensor.is_pinned`` asks about the start of the view's storage, which for a view
        into a whole mapped file is the file's first page, never registered)."""
        attributes = _PointerAttributes()
        for address in (view.data_ptr(), view.data_ptr() + max(view.nbytes, 1) - 1):
            status = self._cudart.cudaPointerGetAttributes(ctypes.byref(attributes), address)
            if status != 0:
                self._clear(status)
                return False
            if attributes.type != MEMORY_TYPE_HOST:
                return False
        return True

    def _clear(self, status: int) -> str:
        """The error's name and text, after clearing the runtime's sticky last error."""
        self._cudart.cudaGetLastError()
        text = self._cudart.cudaGetErrorString(status)
        return f"CUDA error {status} ({text.decode() if text else 'unknown'})"
