"""Where a recorded window's peak GPU memory is: replay of a CUDA allocator trace, grouped by source line.

Input: the dict ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history(stacks="python")`` (torch 2.1 ... 2.13 format):
``{"segments": [...], "device_traces": [[entry, ...] per device]}``, an entry being
``{"action", "addr", "size", "stream", "frames": [{"filename", "line", "name"}, ...], "time_us"?}``
with frames innermost first; a segment ``{"device", "address", "blocks": [{"address"?, "size",
"requested_size"?, "state", "frames"?}]}``. Missing keys are tolerated (older formats, no stacks).

Replay (one device): ``alloc`` adds the entry's (requested) size; a block stops counting at its
``free_requested`` -- where torch's ``allocated_bytes`` drops, so the peak found here is the one
``torch.cuda.max_memory_allocated`` reports (up to the allocator's rounding of each block to 512 B,
or a larger unsplit block) -- or at ``free_completed`` when ``free_requested`` was not recorded.
Blocks allocated before recording began (or before a full ring buffer's first kept entry) form the
baseline: those freed inside the window (a free without an alloc) and those still
``active_allocated`` in ``segments`` at the end that the trace did not allocate.

Attribution of a block alive at the peak: ``labels`` (address -> (category, key)) for blocks alive
from the peak to the snapshot (e.g. parameters, optimizer state, read off the live tensors); else the
innermost frame whose file is not inside ``torch/``, as ``"pkg/relative/path.py:line function"``;
with no Python frame at the allocation (ops run by the autograd engine's device thread) the site that
freed it. Category: labelled; "allocated before recording"; "optimizer state" (a frame in ``optim/``
or named ``*adamw*``); "parameter/gradient" (``AccumulateGrad`` in a C++ frame, or freed by
``zero_grad``); "checkpoint recompute" / "checkpointed forward" (``torch/utils/checkpoint.py`` in the
stack, recompute when under its unpack hook); "liger_losses"; "autograd engine (no Python frame)";
"other". Pure Python; only :func:`start_recording` / :func:`stop_recording` / :func:`tensor_labels`
touch torch (imported lazily).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

MIB = 1024.0**2
BASELINE_KEY = "<allocated before recording>"
NO_FRAME_KEY = "<no Python frame at allocation or free>"
_TORCH_INSTALLED_RE = re.compile(r"(torch-[^/]*\.egg/)?torch/")
_PACKAGE_MARKERS = ("liger_losses/", "benchmark/", "tests/")
_RECOMPUTE_NAMES = ("unpack_hook", "recompute_fn", "unpack_hook_with_error_cb", "backward")


# --------------------------------------------------------------------------- results


@dataclass
class Group:
    """Blocks alive at the peak that share one (category, key): total bytes and block count."""

    category: str
    key: str
    nbytes: int = 0
    count: int = 0


@dataclass
class PeakReport:
    """The peak of one device's recorded window and what was alive then (bytes are requested sizes)."""

    device: int
    n_events: int
    peak_index: int  # index into the device trace of the alloc that reached the peak; -1: at the start
    peak_time_ms: float  # since the first event (nan without "time_us")
    total_bytes: int  # allocated at the peak (sum of requested sizes)
    rounded_bytes: int  # the same with every traced block rounded up to 512 B (segment blocks: real size)
    baseline_bytes: int  # of total: allocated before recording, alive at the peak
    groups: list[Group] = field(default_factory=list)  # by bytes, largest first
    categories: list[Group] = field(default_factory=list)  # the same per category (key "")
    peak_key: str = ""  # attribution of the allocation that reached the peak
    peak_category: str = ""
    peak_size: int = 0
    peak_stack: list[str] = field(default_factory=list)  # its Python frames, innermost first
    anomalies: int = 0  # allocs over a live address, frees of blocks already freed
    ooms: int = 0


@dataclass
class _Block:
    addr: int
    size: int
    rounded: int
    start: int  # event index of the alloc; -1 before recording
    end: float = math.inf  # event index where it stopped counting
    frames: list = field(default_factory=list)
    free_frames: list = field(default_factory=list)
    baseline: bool = False


# --------------------------------------------------------------------------- frames


def package_path(filename: str) -> str:
    """Path relative to its package root: after ``site-packages/``, or from ``liger_losses/`` /
    ``benchmark/`` / ``tests/``, else the last two components."""
    f = filename.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in f:
            return f.rsplit(marker, 1)[1]
    for marker in _PACKAGE_MARKERS:
        i = f.rfind("/" + marker)
        if i >= 0:
            return f[i + 1:]
        if f.startswith(marker):
            return f
    return "/".join(f.split("/")[-2:])


def _is_python(frame: Mapping) -> bool:
    return str(frame.get("filename", "")).endswith(".py")


def _is_torch(frame: Mapping) -> bool:
    """A frame of torch's own files. Inside an install, by the path after ``site-packages/`` (a
    ``/torch/`` further up, as in the GPU image's ``/opt/torch/.venv/...``, must not make transformers'
    or TRL's frames torch's; an egg's ``torch-X.egg/torch/`` is torch's). Elsewhere (a source checkout):
    a ``torch/`` directory that holds the file, unless the path is one of ours or an environment's
    standard library (``envs/torch/lib/python3.x/``)."""
    f = str(frame.get("filename", "")).replace("\\", "/")
    if "site-packages/" in f or "dist-packages/" in f:
        return bool(_TORCH_INSTALLED_RE.match(package_path(f)))
    if any(f.startswith(m) or ("/" + m) in f for m in _PACKAGE_MARKERS):
        return False
    i = f.rfind("/torch/") if not f.startswith("torch/") else 0
    return i >= 0 and "/lib/python" not in f[i:]


def frame_label(frame: Mapping) -> str:
    """``"pkg/path.py:line function"`` of one frame."""
    return f"{package_path(str(frame.get('filename', '?')))}:{frame.get('line', '?')} {frame.get('name', '?')}"


def attribution(frames: Iterable[Mapping]) -> str:
    """Innermost Python frame outside ``torch/``; else the innermost ``torch/`` Python frame; else the
    innermost other (C++) frame's name; "" when there are no frames."""
    frames = list(frames or [])
    py = [f for f in frames if _is_python(f)]
    for f in py:
        if not _is_torch(f):
            return frame_label(f)
    if py:
        return frame_label(py[0])
    if frames:
        return f"[C++] {frames[0].get('name', '?')}"
    return ""


def _text(frames: Iterable[Mapping]) -> str:
    return " ".join(f"{str(f.get('filename', '')).replace(chr(92), '/')} {f.get('name', '')}" for f in frames or [])


def category(frames: Iterable[Mapping], free_frames: Iterable[Mapping] = ()) -> str:
    """Coarse category of a traced block from its allocation (and free) stack; see the module doc."""
    frames = list(frames or [])
    text = _text(frames)
    low = text.lower()
    if "/optim/" in low or "adamw" in low:
        return "optimizer state"
    if "AccumulateGrad" in text or any(f.get("name") == "zero_grad" for f in free_frames or []):
        return "parameter/gradient"
    ckpt = [f for f in frames if str(f.get("filename", "")).replace("\\", "/").endswith("torch/utils/checkpoint.py")]
    if ckpt:
        if any(f.get("name") in _RECOMPUTE_NAMES for f in ckpt):
            return "checkpoint recompute"
        return "checkpointed forward"
    if any("liger_losses/" in str(f.get("filename", "")).replace("\\", "/") for f in frames):
        return "liger_losses"
    if not any(_is_python(f) for f in frames):
        return "autograd engine (no Python frame)"
    return "other"


# --------------------------------------------------------------------------- replay


def _round512(size: int) -> int:
    return max(512, (size + 511) // 512 * 512)


def _pick_device(traces: list, device: Optional[int]) -> Optional[int]:
    if device is not None:
        return device if 0 <= device < len(traces) and traces[device] else None
    for i, t in enumerate(traces):
        if t:
            return i
    return None


def _replay(trace: list) -> tuple[list[_Block], dict[int, _Block], int, int]:
    """All blocks of the trace with their [start, end) event indices; the blocks live at the end."""
    blocks: list[_Block] = []
    live: dict[int, _Block] = {}
    pending: dict[int, _Block] = {}  # free requested, completion not yet seen
    anomalies = ooms = 0
    for i, e in enumerate(trace):
        action = e.get("action")
        addr = e.get("addr")
        size = int(e.get("size", 0) or 0)
        frames = e.get("frames") or []
        if action == "alloc":
            if addr in live:  # a missed free: the old block ends here
                anomalies += 1
                live.pop(addr).end = i
            pending.pop(addr, None)
            b = _Block(addr, size, _round512(size), i, frames=frames)
            blocks.append(b)
            live[addr] = b
        elif action == "free_requested":
            b = live.pop(addr, None)
            if b is None:  # allocated before recording
                b = _Block(addr, size, _round512(size), -1, frames=[], baseline=True)
                blocks.append(b)
            b.end = i
            b.free_frames = frames
            pending[addr] = b
        elif action == "free_completed":
            if pending.pop(addr, None) is not None:
                continue
            b = live.pop(addr, None)
            if b is None:
                b = _Block(addr, size, _round512(size), -1, frames=[], baseline=True)
                blocks.append(b)
            b.end = i
            b.free_frames = b.free_frames or frames
        elif action == "oom":
            ooms += 1
    return blocks, live, anomalies, ooms


def _segment_baseline(segments: list, device: int, live_end: Mapping[int, _Block]) -> list[_Block]:
    """Blocks active at the snapshot that the trace did not allocate: allocated before recording."""
    out = []
    for seg in segments or []:
        if seg.get("device", device) != device:
            continue
        addr = seg.get("address", 0)
        for blk in seg.get("blocks", []):
            size = int(blk.get("size", 0))
            baddr = blk.get("address", addr)
            addr = baddr + size
            if blk.get("state") != "active_allocated" or baddr in live_end:
                continue
            req = int(blk.get("requested_size") or size)
            out.append(_Block(baddr, req, size, -1, frames=blk.get("frames") or [], baseline=True))
    return out


def analyze(snapshot: Mapping[str, Any], *, device: Optional[int] = None,
            labels: Optional[Mapping[int, tuple[str, str]]] = None) -> Optional[PeakReport]:
    """Replay one device's trace and attribute the blocks alive at its peak; None without a trace.

    ``device``: index into ``device_traces`` (default: the first non-empty one). ``labels``:
    block address -> (category, key), applied to blocks alive from the peak to the snapshot.
    """
    traces = list((snapshot or {}).get("device_traces") or [])
    dev = _pick_device(traces, device)
    if dev is None:
        return None
    trace = list(traces[dev])
    blocks, live_end, anomalies, ooms = _replay(trace)
    blocks += _segment_baseline(snapshot.get("segments") or [], dev, live_end)
    labels = labels or {}

    # running total relative to the start; the baseline only shifts it
    delta = [0] * (len(trace) + 1)
    for b in blocks:
        if b.start >= 0:
            delta[b.start] += b.size
        if b.end != math.inf:
            delta[int(b.end)] -= b.size
    cur, best, peak = 0, 0, -1
    for i in range(len(trace)):
        cur += delta[i]
        if cur > best:
            best, peak = cur, i
    alive = [b for b in blocks if b.start <= peak < b.end]

    groups: dict[tuple[str, str], Group] = {}
    cats: dict[str, Group] = {}
    for b in alive:
        if b.end == math.inf and b.addr in labels:
            cat, key = labels[b.addr]
        elif b.baseline:
            cat, key = "allocated before recording", BASELINE_KEY
        else:
            cat = category(b.frames, b.free_frames)
            key = attribution(b.frames)
            if not key:
                freed = attribution(b.free_frames)
                key = f"freed at {freed}" if freed else NO_FRAME_KEY
        g = groups.setdefault((cat, key), Group(cat, key))
        g.nbytes += b.size
        g.count += 1
        c = cats.setdefault(cat, Group(cat, ""))
        c.nbytes += b.size
        c.count += 1

    times = [e.get("time_us") for e in trace]
    t0 = next((t for t in times if t is not None), None)
    peak_time_ms = float("nan")
    if peak >= 0 and t0 is not None and times[peak] is not None:
        peak_time_ms = (times[peak] - t0) / 1e3

    report = PeakReport(
        device=dev, n_events=len(trace), peak_index=peak, peak_time_ms=peak_time_ms,
        total_bytes=sum(b.size for b in alive), rounded_bytes=sum(b.rounded for b in alive),
        baseline_bytes=sum(b.size for b in alive if b.baseline),
        groups=sorted(groups.values(), key=lambda g: (-g.nbytes, g.category, g.key)),
        categories=sorted(cats.values(), key=lambda g: (-g.nbytes, g.category)),
        anomalies=anomalies, ooms=ooms)
    if peak >= 0:
        e = trace[peak]
        frames = e.get("frames") or []
        report.peak_size = int(e.get("size", 0) or 0)
        report.peak_key = attribution(frames) or NO_FRAME_KEY
        report.peak_category = category(frames)
        report.peak_stack = [frame_label(f) for f in frames if _is_python(f)]
    return report


# --------------------------------------------------------------------------- text


def _mib(n: float) -> str:
    # three decimals (KiB): a difference of a few hundred KiB between two providers' peaks shows
    return f"{n / MIB:.3f}"


def format_report(r: PeakReport, *, top: int = 25, max_allocated: Optional[int] = None) -> str:
    """Text summary of a :class:`PeakReport`: totals, the peak event, per-category and top groups."""
    total = max(r.total_bytes, 1)
    lines = [
        f"peak allocated on device {r.device}: {_mib(r.total_bytes)} MiB (sum of requested sizes; "
        f"{_mib(r.rounded_bytes)} MiB with blocks rounded to 512 B)",
    ]
    if max_allocated is not None:
        lines.append(f"torch.cuda.max_memory_allocated over the same steps: {_mib(max_allocated)} MiB "
                     f"(may exceed the rounded sum by unsplit blocks, <= 1 MiB each for large ones)")
    lines.append(f"  of which allocated before recording: {_mib(r.baseline_bytes)} MiB "
                 f"(alive at the peak; labelled below where known)")
    when = "at the start of the recording" if r.peak_index < 0 else f"at event {r.peak_index} of {r.n_events}"
    if r.peak_time_ms == r.peak_time_ms:
        when += f", {r.peak_time_ms:.1f} ms after the first event"
    lines.append(f"  reached {when}")
    if r.peak_index >= 0:
        lines.append(f"  by an allocation of {_mib(r.peak_size)} MiB at {r.peak_key} [{r.peak_category}]")
        stack = r.peak_stack[:12]
        if stack:
            lines.append("  its Python stack (innermost first): " + " <- ".join(stack))
    if r.anomalies or r.ooms:
        lines.append(f"  note: {r.anomalies} inconsistent trace events, {r.ooms} OOM events")
    lines.append("")
    lines.append("by category at the peak:")
    lines.append(f"  {'MiB':>10} {'%':>6} {'blocks':>7}  category")
    for c in r.categories:
        lines.append(f"  {_mib(c.nbytes):>10} {100 * c.nbytes / total:>5.1f}% {c.count:>7}  {c.category}")
    lines.append("")
    lines.append(f"top {min(top, len(r.groups))} of {len(r.groups)} groups at the peak "
                 "(category | innermost non-torch frame):")
    lines.append(f"  {'MiB':>10} {'%':>6} {'blocks':>7}  category | where")
    for g in r.groups[:top]:
        lines.append(f"  {_mib(g.nbytes):>10} {100 * g.nbytes / total:>5.1f}% {g.count:>7}  {g.category} | {g.key}")
    rest = r.groups[top:]
    if rest:
        nbytes = sum(g.nbytes for g in rest)
        lines.append(f"  {_mib(nbytes):>10} {100 * nbytes / total:>5.1f}% {sum(g.count for g in rest):>7}  "
                     f"({len(rest)} more groups)")
    return "\n".join(lines) + "\n"


def peak_breakdown(snapshot: Mapping[str, Any], *, top: int = 25, device: Optional[int] = None,
                   labels: Optional[Mapping[int, tuple[str, str]]] = None,
                   max_allocated: Optional[int] = None) -> str:
    """Text breakdown of the peak allocated memory of a ``torch.cuda.memory._snapshot()`` dict (see
    :func:`analyze`); a one-line explanation when it holds no allocation trace."""
    r = analyze(snapshot, device=device, labels=labels)
    if r is None:
        return ("no allocation trace in the snapshot (device_traces empty: was "
                "torch.cuda.memory._record_memory_history enabled on this device before the steps?)\n")
    return format_report(r, top=top, max_allocated=max_allocated)


# --------------------------------------------------------------------------- recording (torch, lazily)


def start_recording(max_entries: int = 1_000_000) -> None:
    """Start recording the CUDA allocator's alloc/free history with Python stacks (torch >= 2.1
    keywords; falls back to the older ``enabled=True`` / ``trace_alloc_*`` form)."""
    import torch

    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=max_entries)
    except TypeError:
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=max_entries,
                                                 trace_alloc_record_context=True)


def stop_recording() -> None:
    """Stop recording the allocator history (either signature)."""
    import torch

    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except TypeError:
        torch.cuda.memory._record_memory_history(False)


def tensor_labels(named_sources: Mapping[str, Any], optimizer: Any = None) -> dict[int, tuple[str, str]]:
    """Block address -> (category, key) for the storages of live tensors: each source's parameters
    (and their ``.grad``) and buffers, and the optimizer's state tensors."""
    import torch

    labels: dict[int, tuple[str, str]] = {}

    def put(t, cat, key):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            labels.setdefault(t.untyped_storage().data_ptr(), (cat, key))

    for name, module in named_sources.items():
        if module is None:
            continue
        cat = "reference model" if "ref" in name else "parameter/gradient"
        for p in module.parameters():
            put(p, cat, f"<{name} parameters>")
            put(p.grad, "parameter/gradient", f"<{name} gradients (.grad)>")
        for b in module.buffers():
            put(b, cat, f"<{name} buffers>")
    if optimizer is not None:
        for state in getattr(optimizer, "state", {}).values():
            for k, v in (state.items() if isinstance(state, dict) else []):
                put(v, "optimizer state", f"<optimizer state: {k}>")
    return labels
