"""The GPU a process runs on, as a build decision and a benchmark must name
it: the card's name, compute capability and SM count, the driver, the cuBLAS
library the process loaded, torch, and the card's HBM peak.

``card_facts(device)`` reads them (CUDA only); ``hbm_peak(name, clock_khz,
bus_bits)`` gives the peak in bytes per second:

- from ``HBM_PEAK``, the vendors' published figures by card name (the first
  entry whose words all appear in the name, so "H100 PCIe" is tried before
  "H100");
- else from the memory clock and bus width the driver reports, as
  ``2 x clock x width / 8`` (double data rate; for an H100 SXM 2619 MHz and
  5120 bits give 3.35 TB/s);
- else None (the benchmark then prints no fraction of peak rather than
  another card's).

The cuBLAS version is the loaded ``libcublasLt``'s own answer
(``cublasLtGetVersion``), the one whose heuristics pick the split order the
build-time check finds: not the version torch was built against.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import asdict, dataclass

# Published HBM peaks, bytes per second, by words of the card's name (in
# order: the more specific names first).
HBM_PEAK: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 2.0e12),
    (("H100", "NVL"), 3.9e12),
    (("H100",), 3.35e12),  # H100 SXM5 80GB HBM3
    (("H800",), 3.35e12),
    (("GH200", "144"), 4.9e12),
    (("GH200",), 4.0e12),
    (("H200",), 4.8e12),
    (("H20",), 4.0e12),
    (("B200",), 8.0e12),
    (("B300",), 8.0e12),
    (("GB200",), 8.0e12),
    (("A100", "40GB"), 1.555e12),
    (("A100",), 2.039e12),
)

# cuDeviceGetAttribute's attributes for the fallback (cuda.h).
_MEMORY_CLOCK_RATE = 36  # kHz
_GLOBAL_MEMORY_BUS_WIDTH = 37  # bits


@dataclass(frozen=True)
class CardFacts:
    """One GPU as a decision made on it depends on it (module docstring).
    ``key()`` is the stable hash a decision cache files under."""

    name: str
    capability: tuple[int, int]
    sms: int
    driver: str
    cublas: str
    torch: str
    hbm_peak: float | None

    def key(self) -> str:
        text = repr((self.name, self.capability, self.sms, self.driver, self.cublas, self.torch))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """The card in words: name, SMs, HBM peak, driver and cuBLAS."""
        peak = f"{self.hbm_peak / 1e12:.2f} TB/s HBM peak" if self.hbm_peak else "HBM peak unknown"
        return (f"{self.name} ({self.sms} SMs, {peak}; driver {self.driver}, cuBLAS {self.cublas}, "
                f"torch {self.torch})")

    def as_dict(self) -> dict:
        return asdict(self)


def hbm_peak(name: str, clock_khz: int | None = None, bus_bits: int | None = None) -> float | None:
    """The HBM peak of the card called ``name`` in bytes per second
    (``HBM_PEAK``), else from its memory clock (kHz) and bus width (bits),
    else None. TypeError for a name that is no string."""
    if not isinstance(name, str):
        raise TypeError(f"a card's name is a str, not {type(name).__name__}")
    words = name.upper()
    for needed, peak in HBM_PEAK:
        if all(word.upper() in words for word in needed):
            return peak
    if clock_khz and bus_bits and clock_khz > 0 and bus_bits > 0:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8
    return None


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_version(lib) -> str:
    if lib is None:
        return "unknown"
    v = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return "unknown"
    return f"{v.value // 1000}.{v.value % 1000 // 10}"


def _attribute(lib, attribute: int, ordinal: int) -> int | None:
    if lib is None:
        return None
    dev, v = ctypes.c_int(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    if lib.cuDeviceGetAttribute(ctypes.byref(v), attribute, dev) != 0:
        return None
    return v.value


def cublas_version() -> str:
    """The version of the ``libcublasLt`` this process has loaded (torch
    loads it with its first GEMM: call one first), as ``major.minor.patch``;
    "unknown" where none is loaded or it does not answer."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublasLt" in line and "/" in line}
    except OSError:
        return "unknown"
    for path in sorted(paths):
        try:
            v = int(ctypes.CDLL(path).cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return "unknown"


def card_facts(device=None) -> CardFacts:
    """The facts of the CUDA ``device`` (default: the current one); runs one
    tiny GEMM first so that cuBLAS is loaded. ValueError off CUDA."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"card facts are read from a CUDA device, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    a = torch.ones(1, 16, dtype=torch.bfloat16, device=device)
    torch.nn.functional.linear(a, a)  # loads cuBLAS(Lt)
    torch.cuda.synchronize(device)
    lib = _libcuda()
    peak = hbm_peak(props.name, _attribute(lib, _MEMORY_CLOCK_RATE, index),
                    _attribute(lib, _GLOBAL_MEMORY_BUS_WIDTH, index))
    return CardFacts(props.name, (props.major, props.minor), props.multi_processor_count, _driver_version(lib),
                     cublas_version(), torch.__version__, peak)


__all__ = ["HBM_PEAK", "CardFacts", "card_facts", "cublas_version", "hbm_peak"]
