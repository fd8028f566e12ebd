"""Helpers the end-to-end tests share: their command line and main loop, a `moeinfer serve`
process, polling, the Prometheus text format, headless Chromium and a PNG reader. Not a test
itself (CMake runs test_*.py only)."""
from __future__ import annotations

import argparse
import atexit
import os
import pathlib
import queue
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import traceback
import zlib

START_TIMEOUT = 180.0
WAIT_TIMEOUT = 60.0


class ServerProcess:
    """`moeinfer serve` on port 0; the port comes from its log line."""

    def __init__(self, moeinfer: str, extra: list[str]):
        self.proc = subprocess.Popen([moeinfer, "serve", "--port", "0", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        self.port = None
        while self.port is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                self.stop()
                raise AssertionError(f"server did not start: {''.join(self.log)}")
            try:
                line = self.lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
        self.base = f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def client(self, api_key: str = "none"):
        """The official `openai` client on this server (no retries: every answer counts)."""
        from openai import OpenAI  # only the tests that use it need the package
        return OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=300)

    def stop(self) -> int:
        """SIGTERM, then the exit status; killed if it has not drained in two minutes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def parse_args(description: str | None = None, extra=None) -> argparse.Namespace:
    """What ctest passes to every e2e script (--moeinfer, --fixtures), --only NAME to run the
    checks whose names hold NAME, and what `extra(parser)` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--moeinfer", required=True, help="the moeinfer binary")
    parser.add_argument("--fixtures", required=True, type=pathlib.Path,
                        help="the fixtures folder (tests/fixtures)")
    parser.add_argument("--only", help="run the checks whose names contain this")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def demo_model(fixtures: pathlib.Path) -> pathlib.Path:
    """The built-in demo model's folder (models/demo beside tests/fixtures' tests/)."""
    return pathlib.Path(fixtures).resolve().parent.parent / "models" / "demo"


def check_name(check) -> str:
    return check[0] if isinstance(check, tuple) else check.__name__.removeprefix("check_")


def selected(checks, only: str | None) -> list:
    return [c for c in checks if not only or only in check_name(c)]


def run_checks(checks, run=None) -> tuple[int, int]:
    """Runs each check (a function, or a (name, function) pair) through `run(check)`, or
    calls it when `run` is None; one PASS / FAIL line each; (passed, failed)."""
    passed = failed = 0
    for check in checks:
        name = check_name(check)
        if isinstance(check, tuple):
            check = check[1]
        try:
            run(check) if run is not None else check()
            print(f"PASS {name}", flush=True)
            passed += 1
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            failed += 1
    return passed, failed


def skip_checks(checks, why: str) -> int:
    """One SKIP line for each check that cannot run; the number of them (each a failure)."""
    for check in checks:
        print(f"SKIP {check_name(check)}: {why}", flush=True)
    return len(checks)


def serve_and_run(moeinfer: str, flags: list[str], checks, run,
                  server_class=ServerProcess, clean_exit: bool = False) -> tuple[int, int]:
    """`moeinfer serve FLAGS`, then each check through `run(server, check)`, then SIGTERM:
    (passed, failed). A server that does not start (a build without cpp-httplib, say) is one
    failure; with `clean_exit`, so is an exit status other than 0."""
    try:
        server = server_class(moeinfer, flags)
    except Exception as e:  # noqa: BLE001 - reported as a failure
        print(f"FAIL start: {type(e).__name__}: {e}", flush=True)
        return 0, 1
    try:
        passed, failed = run_checks(checks, lambda check: run(server, check))
    finally:
        code = server.stop()
    if clean_exit and code != 0:
        print(f"FAIL exit: the server exited {code}", flush=True)
        failed += 1
    return passed, failed


def summary(passed: int, failed: int) -> int:
    """The last line every e2e script prints, and its exit status."""
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def wait_for(condition, what: str) -> None:
    """Polls a state the server reaches on its own (bounded; not a timing assertion)."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format: series name (with labels) -> value."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("headless Chromium is required for this test but was not found on PATH "
                         "(install Debian's `chromium`: scripts/install-deps.sh does)")


def chromium(args: list[str], window: tuple[int, int],
             profile_dir: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Headless Chromium with a window of `window` pixels; raises on a non-zero exit."""
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", f"--window-size={window[0]},{window[1]}"]
    if profile_dir is not None:
        cmd.append(f"--user-data-dir={profile_dir}")
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise AssertionError(f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def png_info(path: pathlib.Path) -> tuple[int, int, int]:
    """Width, height and the number of distinct byte values in a sample of the pixel data."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    pixels = zlib.decompress(idat)
    return width, height, len(set(pixels[::101]))


def private_mpi_session_base() -> str:
    """A directory of its own for one mpirun's session files. Open MPI 4.1 makes its session
    directory under the temporary directory without tolerating a concurrent mkdir of the same
    path, so two launches starting together (CTest runs tests in parallel) can fail with
    "File exists"; a private base keeps launches apart. Removed when this process exits."""
    base = tempfile.mkdtemp(prefix="moe-ompi-")
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    return base


def mpi_env() -> dict:
    """The environment for one mpirun in tests: CI runs as root, ranks share its two cores, and
    each launch has its own session directory."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "MOE_NUM_THREADS": "1",
                "OMPI_MCA_orte_tmpdir_base": private_mpi_session_base()})
    return env


def mpirun_path() -> str:
    launcher = shutil.which("mpirun")
    assert launcher, "mpirun not found (scripts/install-deps.sh installs openmpi-bin)"
    return launcher


def run_command(cmd: list[str], ok: bool = True, mpi: bool = False) -> subprocess.CompletedProcess:
    """Runs cmd (in mpi_env() with `mpi`); with `ok` a non-zero exit fails with its stderr."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=mpi_env() if mpi else None)
    if ok:
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}: {r.stderr[-2000:]}"
    return r


def mpirun(n: int, args: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    """`mpirun -np n ARGS` through run_command."""
    return run_command([mpirun_path(), "-np", str(n), *args], ok=ok, mpi=True)
