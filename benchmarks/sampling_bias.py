"""How far py-spy's samples are from where a process spends its time, by sampling mode.

    .venv/bin/python benchmarks/sampling_bias.py [--duration 8] [--sample-rate 200]

A child process alternates two functions for the whole run: `python_work` (arithmetic in
Python, no system call) and `system_calls` (`os.getpid()` five times: a system call each, as the
gateway's socket writes, reads and clock reads are). It first times each alone, so the share of
its time in system calls is known. py-spy (the `bench` extra) then samples it twice: in its
default mode, which stops the process to read each stack (also `--native`), and with
`--nonblocking`, which reads the stacks while the process runs. A sampler that sees the process
as it runs puts the known share of its samples in `system_calls`; this is the check that
`cpu_profile.py` samples the non-stop way for that reason.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import services

CHILD = """
import os, sys, time

def python_work():
    total = 0
    for i in range(60):
        total += i * i
    return total

def system_calls():
    for _ in range(5):
        os.getpid()

def timed(function, n=100_000):
    start = time.perf_counter()
    for _ in range(n):
        function()
    return time.perf_counter() - start

python_s, syscall_s = timed(python_work), timed(system_calls)
print(syscall_s / (python_s + syscall_s), flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    python_work()
    system_calls()
"""

MODES = {
    "stops the process (py-spy's default)": [],
    "stops the process, native frames (`--native`)": ["--native"],
    "non-stop (`--nonblocking`)": ["--nonblocking"],
}


def sampled_share(py_spy: str, flags: list[str], duration: float, rate: int) -> tuple[float, float]:
    """The known share of the child's time in system calls, and the share of py-spy's samples
    of it (in either function) that land in them."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(duration + 2)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        known = float(child.stdout.readline())
        time.sleep(0.5)
        record = [py_spy, "record", "--pid", str(child.pid), *flags, "--rate", str(rate)]
        record += ["--duration", str(int(duration)), "--format", "raw", "--output", str(raw)]
        subprocess.run(record, check=True, capture_output=True)
        child.wait(timeout=duration + 30)
        in_calls = in_python = 0
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if "system_calls (" in stack:
                in_calls += int(count)
            elif "python_work (" in stack:
                in_python += int(count)
    return known, in_calls / max(in_calls + in_python, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds sampled per mode")
    parser.add_argument("--sample-rate", type=int, default=200, help="py-spy samples per s")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(services.PYTHON).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed (the bench extra has it)", file=sys.stderr)
        return 1
    print("| py-spy mode | time in system calls (timed) | samples in system calls |")
    print("|---|---|---|")
    for mode, flags in MODES.items():
        known, sampled = sampled_share(py_spy, flags, args.duration, args.sample_rate)
        print(f"| {mode} | {known:.0%} | {sampled:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
