"""A hardware profile as the text `offload probe` prints: its units side by side, links, disk, floors and curves."""

from __future__ import annotations

from offload.common.hardware import CURVES, DTYPES, GB, TFLOP, HardwareProfile


def format_profile(p: HardwareProfile) -> str:
    """A readable table of `p`: memories, bandwidths and GEMM rates per unit, links, disk, measured curves."""
    dtypes = [d for d in DTYPES if d in p.device.matmul_flops or d in p.host.matmul_flops]
    rows = [["", "memory", "bandwidth", *(f"{d} matmul" for d in dtypes)]]
    for label, unit in ((f"device ({p.device_kind})", p.device), ("host", p.host)):
        rates = [f"{_short(unit.matmul_flops[d] / TFLOP)} TFLOP/s" if d in unit.matmul_flops else "-" for d in dtypes]
        rows.append([label, f"{_short(unit.memory / GB)} GB", f"{_short(unit.memory_bandwidth / GB)} GB/s", *rates])
    if p.host_to_device or p.device_to_host:
        links = f"host->device {_short(p.host_to_device / GB)} GB/s, device->host {_short(p.device_to_host / GB)} GB/s"
    else:
        links = "none (the device is the host)"
    lines = [
        f"hardware  {p.name}",
        f"source    {p.source}",
        "",
        *_columns(rows),
        "",
        f"links     {links}",
        f"disk      read {_short(p.disk_read / GB)} GB/s, write {_short(p.disk_write / GB)} GB/s",
    ]
    if by_backend := p.disk_read_by_backend:
        rates = ", ".join(f"{b} {_short(r / GB)} GB/s" for b, r in by_backend.items())
        fastest = f" ({max(by_backend, key=by_backend.__getitem__)} fastest)" if len(by_backend) > 1 else ""
        lines.append(f"          read by backend: {rates}{fastest}")
    units = (("device", p.device),) if p.device == p.host else (("device", p.device), ("host", p.host))
    floors = [(label, d, seconds) for label, u in units for d, seconds in u.layer_floor.items()]
    if floors:
        lines += ["", "least a decoder layer costs (a tiny model, one token):"]
        lines += [f"  {label:<6} {dtype:<8}  {_short(seconds * 1e6)} us" for label, dtype, seconds in floors]
    if s := p.served_step:
        lines += [
            "",
            f"served engine (offload serve, a one-layer model, clients on this machine): {_short(s.step * 1e6)} us a "
            f"step, {_short(s.per_stream * 1e6)} us a stream in it, {_short(s.per_prompt_token * 1e6)} us a prompt "
            f"token, {_short(s.request * 1e6)} us a request",
        ]
    for key, (x, unit_name, scale) in CURVES.items():
        curves = [(label, d, c) for label, u in units for d, c in getattr(u, key).items()]
        if curves:
            lines += ["", f"{_CURVE_TITLES[key]}, {unit_name} by {x}:"]
            for label, dtype, curve in curves:
                points = "  ".join(f"{size}: {_short(rate / scale)}" for size, rate in curve)
                lines.append(f"  {label:<6} {dtype:<8}  {points}")
    return "\n".join(lines)


_CURVE_TITLES = {
    "matmul_curve": "matmul [rows, k] x [k, n]",
    "packed_matmul_curve": "the same with the weight packed for the CPU's GEMM (resident layers)",
    "int4_matmul_curve": "the same with int4 codes in groups of 32 (dense FLOPs)",
    "gguf_matmul_curve": "the same with GGUF Q4_0 blocks read in place (dense FLOPs)",
    "gguf_decode_matmul_curve": "the same at a decode step's rows, on AMX tiles (dense FLOPs)",
    "elementwise_curve": "a layer's non-GEMM work (bytes as the cost model counts them)",
    "prefill_attention_curve": "causal attention of whole prompts",
    "decode_attention_curve": "one query per sequence over a paged K/V cache (K and V bytes)",
    "layer_floor_curve": "a tiny decoder layer (the least a layer costs), prompts of up to 128 tokens",
}


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return lines


def _short(x: float) -> str:
    """Three significant digits for tables, without exponent notation for ordinary sizes."""
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"
