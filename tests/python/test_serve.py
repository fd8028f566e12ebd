"""`python -m moeinfer serve` and moeinfer.serve() run the command's server: it answers as the
LLM generates, and SIGTERM / SIGINT drain it (exit 0)."""

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import moeinfer

from conftest import DEMO, REPO

START_TIMEOUT = 180


class Server:
    def __init__(self, argv):
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        self.log = []
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()
        self.port = None
        while self.port is None:
            try:
                line = self.lines.get(timeout=START_TIMEOUT)
            except queue.Empty:
                raise AssertionError("server did not start: " + "".join(self.log))
            if line is None:
                raise AssertionError("server exited: " + "".join(self.log))
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def post(self, path, body):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def stop(self, sig):
        self.proc.send_signal(sig)
        try:
            status = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.reader.join(timeout=60)
        return status


def check_completion(server, demo_llm):
    body = {"prompt": "The meaning of life is", "max_tokens": 24, "temperature": 0}
    answer = server.post("/v1/completions", body)
    (expected,) = demo_llm.generate(body["prompt"],
                                    moeinfer.SamplingParams(temperature=0, max_tokens=24))
    assert answer["choices"][0]["text"] == expected.outputs[0].text


def test_python_m_moeinfer_serve(demo_llm):
    server = Server([sys.executable, "-m", "moeinfer", "serve", str(DEMO), "--port", "0"])
    try:
        check_completion(server, demo_llm)
    finally:
        status = server.stop(signal.SIGTERM)
    assert status == 0, "".join(server.log)
    assert any("SIGTERM, finishing requests" in line for line in server.log)


def test_moeinfer_serve_in_process(demo_llm):
    # serve() in a Python process; Ctrl-C (SIGINT) drains it, serve() returns, and Python's
    # own SIGINT handling is back afterwards (a SIGINT raises KeyboardInterrupt again).
    script = (
        "import os, signal, sys, moeinfer\n"
        f"moeinfer.serve({str(DEMO)!r}, port=0, max_num_seqs=4)\n"
        "print('serve returned', file=sys.stderr, flush=True)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(10 ** 7): pass\n"
        "except KeyboardInterrupt:\n"
        "    print('python handles SIGINT again', file=sys.stderr, flush=True)\n")
    server = Server([sys.executable, "-c", script])
    try:
        check_completion(server, demo_llm)
    finally:
        status = server.stop(signal.SIGINT)
    assert status == 0, "".join(server.log)
    assert any("serve returned" in line for line in server.log), "".join(server.log)
    assert any("python handles SIGINT again" in line for line in server.log), "".join(server.log)
