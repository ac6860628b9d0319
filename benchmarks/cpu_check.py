"""The CPU path's goals measured on this machine in one command: each step bounded in time, its results named by
this CPU, then one table of verdicts.

Steps (default: all four, in this order):
  suite     `bash .ci/run` in a fresh clone of this checkout's HEAD (the tests and the linter, as CI runs them)
  kernels   native_cpu.py: every kernel path the engine takes here against the other path, row count by row count
  prompt    prompt_rate.py: a 2,047-token prompt through the 1.1B checkpoint's 22 layers against torch's bfloat16
            GEMM rate on the same machine
  llamacpp  vs_llamacpp.py: SmolLM2's GGUF file, this engine's int4 against llama.cpp, batches 1 and 16

Goals (docs/benchmarks.md, "Native CPU kernels"): the suite passes; every path taken is at least 0.97x the other;
and, on a CPU with AMX tiles, the prompt at 60% or more of the GEMM rate, int4 at batch 16 at 3x llama.cpp or more
and at batch 1 at 1x or more. On a CPU without AMX the last three are measured and shown, not judged.

Results: RESULTS/cpu_check-TAG-STEP.json and the verdicts in RESULTS/cpu_check-TAG.json, TAG naming the CPU
("epyc", "xeon-amx"); each step's output in RESULTS/cpu_check-TAG-STEP.log. The verdicts are of the steps that
ran: a run of some steps replaces a whole run's file unless --tag names it apart. The suite runs the last commit, as
CI does. Exit status 1 where a goal judged here is not met.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_common import cpuinfo, host, timestamp, write_report
from native_cpu import TAKEN_AT_LEAST

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
STEPS = ("suite", "kernels", "prompt", "llamacpp")
LIMIT_S = {"suite": 5400, "kernels": 1800, "prompt": 1800, "llamacpp": 2700}  # each step's bound, seconds
PROMPT_OF_GEMM = 0.60  # on AMX
LLAMACPP_AT_LEAST = {16: 3.0, 1: 1.0}  # batch -> this engine's int4 over llama.cpp's tokens/s, on AMX


@dataclass(frozen=True, slots=True)
class Verdict:
    """One goal on this machine: what it asks, what was measured, whether it holds (None: not judged here)."""

    goal: str
    measured: str
    met: bool | None
    source: str  # the results file or log it was read from


def cpu_tag() -> str:
    """The CPU's kind in a file name: its family's word ("epyc", "xeon", else the model's first word), "-amx" where
    it has AMX tiles."""
    model = (cpuinfo("model name") or "cpu").lower()
    words = re.findall(r"[a-z0-9]+", model.replace("(r)", " ").replace("(tm)", " "))
    known = [w for w in words if w in ("epyc", "xeon", "ryzen", "core", "neoverse")]
    family = (known or words or ["cpu"])[0]
    return family + ("-amx" if has_amx() else "")


def has_amx() -> bool:
    return "amx_tile" in (cpuinfo("flags") or "").split()


def commands(step: str, out: Path, quick: bool, clone: Path) -> list[str]:
    """The command a step runs, from the repository root (the suite's from its fresh clone)."""
    python = sys.executable
    if step == "suite":
        return ["bash", "-c", f"git clone -q {ROOT} {clone} && cd {clone} && bash .ci/run"]
    if step == "kernels":
        repeats = ["--quick", "--repeats", "1"] if quick else ["--repeats", "3"]
        return [python, "benchmarks/native_cpu.py", *repeats, "--out", str(out)]
    if step == "prompt":
        shape = ["--layers", "2", "--prompt-tokens", "255"] if quick else []
        return [python, "benchmarks/prompt_rate.py", "--repeats", "1", *shape, "--out", str(out)]
    if step == "llamacpp":
        return [python, "benchmarks/vs_llamacpp.py", *(["--quick"] if quick else []), "--out", str(out)]
    raise ValueError(f"unknown step {step!r} (one of {', '.join(STEPS)})")


def run_step(step: str, results: Path, tag: str, quick: bool) -> dict:
    """Run one step under its time bound (coreutils' timeout, which ends the step's whole process group), its
    output to the console and to its log; what ran and how it ended (exit 124: timed out)."""
    out, log = results / f"cpu_check-{tag}-{step}.json", results / f"cpu_check-{tag}-{step}.log"
    with tempfile.TemporaryDirectory(prefix="cpu-check-") as scratch:
        argv = commands(step, out, quick, Path(scratch) / "clone")
        print(f"== {step} (at most {LIMIT_S[step]} s): {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        bounded = ["timeout", "--kill-after=30", str(LIMIT_S[step]), *argv]
        with (
            log.open("w") as sink,
            subprocess.Popen(bounded, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
        ):
            for line in proc.stdout:
                print(line, end="", flush=True)
                sink.write(line)
        status = proc.returncode
    seconds = time.perf_counter() - start
    print(f"== {step}: exit {status}{' (timed out)' if status == 124 else ''} after {seconds:.0f} s", flush=True)
    return {"step": step, "command": argv, "exit": status, "seconds": round(seconds, 1), "log": str(log)}


def judge_suite(ran: dict | None) -> list[Verdict]:
    if ran is None:
        return []
    log = Path(ran["log"])
    tail = log.read_text().splitlines() if log.is_file() else []
    counts = next((ln.strip() for ln in reversed(tail) if re.search(r"\d+ (passed|failed)", ln)), "no summary line")
    ok = ran["exit"] == 0
    return [Verdict("`bash .ci/run` in a fresh clone exits 0", f"exit {ran['exit']}: {counts}", ok, str(log))]


def judge_kernels(report: dict, source: str) -> list[Verdict]:
    rows = report["rows"]
    below = [r for r in rows if r["taken_vs_other"] < TAKEN_AT_LEAST]
    worst = min(rows, key=lambda r: r["taken_vs_other"])
    measured = (
        f"{len(below)} of {len(rows)} rows below; worst {worst['taken_vs_other']:.2f}x "
        f"({worst['kind']} {worst['shape']} at {worst['rows']} rows, {worst['taken']})"
    )
    return [Verdict(f"every path taken >= {TAKEN_AT_LEAST}x the other", measured, not below, source)]


def judge_prompt(report: dict, source: str, amx: bool) -> list[Verdict]:
    timed = report["rows"]["timed"]
    measured = (
        f"{timed['of_gemm']:.0%} ({timed['prefill_gflop_per_s']:.0f} of {timed['gemm_gflop_per_s']:.0f} GFLOP/s; "
        f"{report['prompt_tokens']} tokens, {report['layers']} layers)"
    )
    goal = f"a long prompt at >= {PROMPT_OF_GEMM:.0%} of the bf16 GEMM rate (AMX)"
    return [Verdict(goal, measured, timed["of_gemm"] >= PROMPT_OF_GEMM if amx else None, source)]


def judge_llamacpp(report: dict, source: str, amx: bool) -> list[Verdict]:
    def in_ram(engine: str, batch: int) -> dict | None:
        rows = (r for r in report["rows"] if (r["engine"], r["setting"], r["batch"]) == (engine, "ram", batch))
        return next(rows, None)

    verdicts = []
    for batch, at_least in LLAMACPP_AT_LEAST.items():
        row, peer = in_ram("ours int4", batch), in_ram("llama.cpp", batch)
        goal = f"int4 at batch {batch} >= {at_least:g}x llama.cpp (AMX)"
        if row is None or peer is None:
            verdicts.append(Verdict(goal, "not run", None, source))
        elif row["status"] != "ok" or peer["status"] != "ok":
            failed = f"ours: {row['status']}; llama.cpp: {peer['status']}"
            verdicts.append(Verdict(goal, failed, False if amx else None, source))
        else:
            measured = (
                f"{row['vs_llama_cpp']:.2f}x ({row['tokens_per_second']:.1f} against {peer['tokens_per_second']:.1f} "
                f"tokens/s; llama.cpp repacking: {report.get('llama_cpp_repack') or 'default'})"
            )
            verdicts.append(Verdict(goal, measured, row["vs_llama_cpp"] >= at_least if amx else None, source))
    return verdicts


JUDGES: dict[str, Callable[[dict, str, bool], list[Verdict]]] = {
    "kernels": lambda report, source, amx: judge_kernels(report, source),
    "prompt": judge_prompt,
    "llamacpp": judge_llamacpp,
}


def verdicts(results: Path, tag: str, amx: bool, runs: dict[str, dict]) -> list[Verdict]:
    """The goals of the steps that ran, from their results (a step that failed or wrote none fails its goals)."""
    found = judge_suite(runs.get("suite"))
    for step, judge in JUDGES.items():
        if (ran := runs.get(step)) is None:
            continue
        path = results / f"cpu_check-{tag}-{step}.json"
        if ran["exit"] != 0 or not path.is_file():
            ended = "timed out" if ran["exit"] == 124 else f"exit {ran['exit']}"
            found.append(Verdict(f"{step} runs", f"{ended}: {last_line(Path(ran['log']))}", False, ran["log"]))
        else:
            found.extend(judge(json.loads(path.read_text()), str(path), amx))
    return found


def last_line(log: Path) -> str:
    """A step's last words (its error, where it failed), or "no output"."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    return lines[-1] if lines else "no output"


def table(found: list[Verdict]) -> str:
    shown = {True: "met", False: "NOT MET", None: "shown"}
    width = max((len(v.goal) for v in found), default=4)
    lines = [f"{'goal':<{width}}  {'verdict':<8} measured"]
    lines += [f"{v.goal:<{width}}  {shown[v.met]:<8} {v.measured}" for v in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)} (default all)")
    p.add_argument("--quick", action="store_true", help="each benchmark at its smallest: a check that the steps run")
    p.add_argument("--results", type=Path, default=RESULTS, help="where results, logs and verdicts go")
    p.add_argument("--tag", help="the CPU's name in the files (default: from /proc/cpuinfo, e.g. epyc, xeon-amx)")
    args = p.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if unknown := [s for s in steps if s not in STEPS]:
        raise SystemExit(f"--steps: unknown step {unknown[0]!r} (one of {', '.join(STEPS)})")
    tag, amx = args.tag or cpu_tag(), has_amx()
    args.results.mkdir(parents=True, exist_ok=True)
    runs = {step: run_step(step, args.results, tag, args.quick) for step in steps}
    found = verdicts(args.results, tag, amx, runs)
    print(f"\n{host()['cpu']} ({'AMX tiles' if amx else 'no AMX'}), results tagged {tag}:\n{table(found)}")
    report = {"benchmark": "cpu_check", "date": timestamp(), "machine": host(), "amx": amx, "quick": args.quick}
    report |= {"steps": list(runs.values()), "verdicts": [asdict(v) for v in found]}
    write_report(args.results / f"cpu_check-{tag}.json", report)
    return 1 if any(v.met is False for v in found) else 0


if __name__ == "__main__":
    sys.exit(main())
