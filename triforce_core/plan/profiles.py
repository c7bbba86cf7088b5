"""Memory profiles: what a machine offers the planner (GPU count and bytes, host bytes, bandwidths).

Named profiles are TOML files shipped in `profiles/`; a path to any TOML file works too. Sizes
are bytes or strings such as "24GiB", "600MB" (MB = 10^6 bytes, MiB = 2^20); bandwidths are
GB/s with GB = 10^9 bytes."""
from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path

from triforce.offload.errors import OffloadError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


MAX_BYTES = 1 << 60  # 1 EiB: beyond any machine, so a larger size is a typo
HOST_UNBOUNDED = MAX_BYTES  # a card's profile sets no host bound: the machine's memory does (plan.host_limits)
MAX_GPUS = 64        # per profile: more than any single host holds
MAX_THREADS = 1 << 12


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Bytes from 123, "1.5GiB", "600MB"; raises OffloadError naming `what`."""
    if isinstance(value, bool):
        raise OffloadError(f"{what} must be a size such as '24GiB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise OffloadError(f"{what} must be a size such as '24GiB', '600MB' or a number of bytes, "
                               f"got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(number) or number < 0 or number * _UNITS[unit] > MAX_BYTES:
        raise OffloadError(f"{what} must be a size from 0 to 1 EiB, got {value!r}")
    return int(number * _UNITS[unit])


def format_size(num_bytes: int | float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


@dataclass(frozen=True)
class MemoryProfile:
    """num_gpus 0 means the CPU is the device (device and host share memory)."""
    name: str
    description: str
    num_gpus: int
    gpu_bytes: int            # memory per GPU
    reserved_bytes: int       # headroom per GPU the plan must leave free
    host_bytes: int           # host (pinned) memory the KV store may use (HOST_UNBOUNDED: the machine's decides)
    pcie_h2d_gbps: float
    pcie_d2h_gbps: float
    hbm_gbps: float
    cpu_threads: int
    measured: bool = False
    compute_tflops: float | None = None  # decode-shaped matmul rate; None: plan by bytes only
    layer_overhead_us: float = 0.0       # fixed cost per layer per forward pass (launches, Python)
    attention_gbps: float | None = None  # KV bytes/s of the attention kernel; None: hbm_gbps
    attention_tflops: float | None = None  # attention's arithmetic in a verify pass; None: compute_tflops
    # CPU threads attending over host KV in place (hybrid full verify): KV bytes/s with one query
    # row per KV head, and the arithmetic rate with many; None: no hybrid split (all streamed)
    host_attention_gbps: float | None = None
    host_attention_tflops: float | None = None
    # the block kernels' rates per weight format ((format, rate), ...; a TOML table): block bytes/s
    # with one input row, and TFLOP/s with 16 (a verify pass); () where not measured
    block_gbps: tuple = ()
    block_tflops: tuple = ()
    source: str = ""          # the file it came from
    extras: tuple = ()        # (key, value) pairs a newer tool wrote; kept, not interpreted

    def __post_init__(self):
        if not 0 <= self.num_gpus <= MAX_GPUS:
            raise OffloadError(f"profile {self.name}: field 'num_gpus' must be from 0 to {MAX_GPUS}, "
                               f"got {self.num_gpus}")
        if self.gpu_bytes <= 0:
            raise OffloadError(f"profile {self.name}: field 'gpu_bytes' must be positive")
        if not 0 <= self.reserved_bytes < self.gpu_bytes:
            raise OffloadError(f"profile {self.name}: field 'reserved_bytes' must be >= 0 and below gpu_bytes")
        for name in ("pcie_h2d_gbps", "pcie_d2h_gbps", "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise OffloadError(f"profile {self.name}: field '{name}' must be a positive number of GB/s")
        if not 1 <= self.cpu_threads <= MAX_THREADS:
            raise OffloadError(f"profile {self.name}: field 'cpu_threads' must be from 1 to {MAX_THREADS}")
        if self.compute_tflops is not None and not self.compute_tflops > 0:
            raise OffloadError(f"profile {self.name}: field 'compute_tflops' must be a positive number")
        if self.attention_tflops is not None and not self.attention_tflops > 0:
            raise OffloadError(f"profile {self.name}: field 'attention_tflops' must be a positive number")
        if self.attention_gbps is not None and not self.attention_gbps > 0:
            raise OffloadError(f"profile {self.name}: field 'attention_gbps' must be a positive number of GB/s")
        for name in ("host_attention_gbps", "host_attention_tflops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise OffloadError(f"profile {self.name}: field '{name}' must be a positive number")
        if self.layer_overhead_us < 0:
            raise OffloadError(f"profile {self.name}: field 'layer_overhead_us' must be >= 0")

    @property
    def device_budget_bytes(self) -> int:
        """What a plan may use on each device."""
        return self.gpu_bytes - self.reserved_bytes

    def with_device_budget(self, budget_bytes: int) -> "MemoryProfile":
        """The profile with exactly `budget_bytes` usable per device (--device-budget)."""
        if budget_bytes <= 0:
            raise OffloadError("--device-budget must be positive")
        return replace(self, gpu_bytes=budget_bytes, reserved_bytes=0)


_REQUIRED = {"num_gpus": int, "gpu_bytes": "size", "pcie_h2d_gbps": float, "hbm_gbps": float}
_OPTIONAL = {"name": str, "description": str, "reserved_bytes": "size", "host_bytes": "size", "pcie_d2h_gbps": float,
             "cpu_threads": int, "measured": bool, "compute_tflops": float, "layer_overhead_us": float,
             "attention_gbps": float, "attention_tflops": float, "host_attention_gbps": float,
             "host_attention_tflops": float, "block_gbps": "rates", "block_tflops": "rates"}


# `profile tune` writes these first and last: a tuned file without its last line was cut short
TUNED_HEADER = "# written by `triforce profile tune`\n"
TUNED_FOOTER = "# end of the profile\n"

_KIND_NAMES = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def profile_from_dict(data: dict, source: str) -> MemoryProfile:
    def field(key, kind):
        value = data[key]
        where = f"profile {source}: field '{key}'"
        if kind == "size":
            return parse_size(value, where)
        if kind == "rates":  # a table of weight format -> positive rate
            good = isinstance(value, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in value.values())
            if not good:
                raise OffloadError(f"{where} must be a table of weight formats to positive numbers, got {value!r}")
            return tuple((str(k), float(v)) for k, v in sorted(value.items()))
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML spells them inf and nan
                raise OffloadError(f"{where} must be a finite number, got {value!r}")
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, bool) and isinstance(value, kind):
            return value
        raise OffloadError(f"{where} must be {_KIND_NAMES.get(kind, getattr(kind, '__name__', kind))}, "
                           f"got {value!r}")

    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise OffloadError(f"profile {source}: missing field{'s' if len(missing) > 1 else ''} "
                           + ", ".join(f"'{k}'" for k in missing))
    values = {k: field(k, kind) for k, kind in {**_REQUIRED, **_OPTIONAL}.items() if k in data}
    known = set(_REQUIRED) | set(_OPTIONAL)
    extras = tuple(sorted((k, v) for k, v in data.items() if k not in known))
    return MemoryProfile(
        name=values.get("name", Path(source).stem), description=values.get("description", ""),
        num_gpus=values["num_gpus"], gpu_bytes=values["gpu_bytes"],
        reserved_bytes=values.get("reserved_bytes", 0), host_bytes=values.get("host_bytes", HOST_UNBOUNDED),
        pcie_h2d_gbps=values["pcie_h2d_gbps"], pcie_d2h_gbps=values.get("pcie_d2h_gbps", values["pcie_h2d_gbps"]),
        hbm_gbps=values["hbm_gbps"], cpu_threads=values.get("cpu_threads", 1),
        measured=values.get("measured", False), compute_tflops=values.get("compute_tflops"),
        layer_overhead_us=values.get("layer_overhead_us", 0.0), attention_gbps=values.get("attention_gbps"),
        attention_tflops=values.get("attention_tflops"), host_attention_gbps=values.get("host_attention_gbps"),
        host_attention_tflops=values.get("host_attention_tflops"), block_gbps=values.get("block_gbps", ()),
        block_tflops=values.get("block_tflops", ()), source=source, extras=extras)


def _shipped() -> dict[str, object]:
    folder = resources.files("triforce.profiles")
    return {entry.name[:-5]: entry for entry in folder.iterdir() if entry.name.endswith(".toml")}


def list_profiles() -> list[MemoryProfile]:
    return [load_profile(name) for name in sorted(_shipped())]


def load_profile(spec: str) -> MemoryProfile:
    """A shipped profile by name, or a TOML file by path."""
    shipped = _shipped()
    if spec in shipped:
        text, source = shipped[spec].read_text(encoding="utf-8"), spec
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise OffloadError(f"unknown profile '{spec}' (shipped: {', '.join(sorted(shipped))}; "
                               "or give a path to a .toml file)")
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise OffloadError(f"cannot read profile {path}: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise OffloadError(f"profile {source} is not valid TOML: {e}") from None
    if text.startswith(TUNED_HEADER) and not text.rstrip().endswith(TUNED_FOOTER.strip()):
        absent = [k for k in (*_REQUIRED, *_OPTIONAL) if k not in data and k not in ("name", "host_bytes")]
        raise OffloadError(f"profile {source} is cut short (written by `triforce profile tune`, it lacks its last "
                           f"line){'; fields absent: ' + ', '.join(absent) if absent else ''}: run "
                           f"`triforce profile tune --out {source}` again")
    return profile_from_dict(data, source)


def profile_to_toml(profile: MemoryProfile) -> str:
    """TOML text that load_profile reads back to an equal profile (bar `source`)."""
    lines = []
    for f in fields(MemoryProfile):
        value = getattr(profile, f.name)
        if f.name in ("source", "extras") or value is None or value == () or \
                (f.name == "host_bytes" and value == HOST_UNBOUNDED):
            continue
        if f.name in ("block_gbps", "block_tflops"):
            value = dict(value)
        lines.append(f"{f.name} = {_toml_value(value)}")
    lines += [f"{k} = {_toml_value(v)}" for k, v in profile.extras]
    return "\n".join(lines) + "\n"


def acceptance_table(profile: MemoryProfile) -> list[dict]:
    """Acceptance figures stored with the profile (rows of `triforce eval acceptance --json`)."""
    rows = dict(profile.extras).get("acceptance", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise OffloadError(f"profile {profile.name}: field 'acceptance' must be a list of tables")
    return rows


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
