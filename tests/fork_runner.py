"""Run entry points (pretrain_gpt.py, tools/*.py) as real processes without paying for Python's
and torch's start-up each time: a server process imports torch and megalite once, then forks a
child per request. The child is a process of its own (its own exit status, stdout and stderr
files, working directory), runs the script as `python script args` would (`__main__`,
sys.argv, sys.path[0]), and prints an uncaught exception's traceback as the interpreter does, so
a test that asserts "exit status 2, one error line, no traceback" checks what a user would see.
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
from dataclasses import dataclass

_SERVER = r"""
import json, os, runpy, sys, traceback
import numpy, torch  # the costly imports, paid once: children inherit them
import megalite.training, megalite.generation, megalite.checkpoint.offline  # noqa: F401
requests = sys.stdin
reply = os.fdopen(os.dup(1), "w")
for line in requests:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path in ((1, req["out"]), (2, req["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.argv = [req["tool"], *req["args"]]
            sys.path[0] = os.path.dirname(req["tool"])
            try:
                runpy.run_path(req["tool"], run_name="__main__")
                code = 0
            except SystemExit as e:  # as the interpreter reads sys.exit's argument
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")
    reply.flush()
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class ForkRunner:
    """`n` servers; `run` may be called from n threads at once (each takes a free server)."""

    def __init__(self, n: int, env: dict):
        self._free: queue.Queue = queue.Queue()
        self._servers = [subprocess.Popen([sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True) for _ in range(n)]
        for s in self._servers:
            self._free.put(s)

    def run(self, tool: str, args: list[str], cwd: str, logs: str) -> Result:
        """Run `tool args` in `cwd`; its stdout and stderr go to logs.out / logs.err."""
        server = self._free.get()
        try:
            request = {"tool": tool, "args": list(args), "cwd": cwd, "out": logs + ".out", "err": logs + ".err"}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            line = server.stdout.readline()
            if not line:
                raise RuntimeError(f"the fork server died (status {server.poll()})")
            code = json.loads(line)
        finally:
            self._free.put(server)
        with open(logs + ".out") as out, open(logs + ".err") as err:
            return Result(code, out.read(), err.read())

    def close(self) -> None:
        for s in self._servers:
            s.stdin.close()
            s.wait(timeout=30)
