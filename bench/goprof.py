"""A Go component's CPU profile over a window, from its /debug/pprof endpoint, and the text summary
that bench/results/ keeps: `go tool pprof`'s top functions, by own and by cumulative time.

kube-apiserver serves /debug/pprof/profile?seconds=N only with --profiling (hack/cluster-up.sh
passes DDPJOB_API_PROFILING), and ends a request after its --request-timeout (a minute): a window
longer than that is recorded as consecutive CHUNK-second profiles, merged at the end. Sampling is
Go's own (100 Hz, in the process): it adds nothing another process must compute.

    .venv/bin/python bench/goprof.py PROFILE.pb.gz [MORE.pb.gz ...]   # print the summary of profiles
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import threading
from pathlib import Path

CHUNK = 30  # seconds per request: under kube-apiserver's default 60 s request timeout
TOP = 30


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("go is not on PATH: `go tool pprof` reads the profiles (hack/build.sh needs it too)")
    return go


class Recorder:
    """Consecutive CHUNK-second CPU profiles of the API server behind `api` (a kubernetes ApiClient,
    admin) into `prefix`-N.pb.gz, from now until stop()."""

    def __init__(self, api, prefix: Path, *, chunk: int = CHUNK) -> None:
        self.api, self.prefix, self.chunk = api, prefix, chunk
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.files: list[Path] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="apiserver-pprof", daemon=True)
        self._thread.start()

    def _one(self, path: Path) -> None:
        method, url, headers, body, _ = self.api.param_serialize(
            "GET", "/debug/pprof/profile", query_params=[("seconds", str(self.chunk))], auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=self.chunk + 60)
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}"
                               + (": the API server runs without --profiling (make cluster-down, then start it "
                                  "with DDPJOB_API_PROFILING=true)" if resp.status == 404 else f": {data[:200]!r}"))
        path.write_bytes(data)

    def _run(self) -> None:
        while not self._stop.is_set():
            path = Path(f"{self.prefix}-{len(self.files)}.pb.gz")
            try:
                self._one(path)
            except Exception as exc:  # noqa: BLE001  (recorded: the bench's other numbers stand)
                self.error = f"GET /debug/pprof/profile: {exc}"
                return
            self.files.append(path)

    def stop(self) -> list[Path]:
        """Stop after the chunk in flight (at most CHUNK s); the profiles recorded."""
        self._stop.set()
        self._thread.join(timeout=self.chunk + 90)
        return list(self.files)


def top(files: list[Path], *, cum: bool = False, nodes: int = TOP) -> str:
    """`go tool pprof -top` over `files` merged: functions by own (flat) or cumulative CPU time."""
    args = [_go(), "tool", "pprof", "-top", f"-nodecount={nodes}"] + (["-cum"] if cum else [])
    return subprocess.run(args + [str(f) for f in files], capture_output=True, text=True, check=True,
                          timeout=300).stdout


def summarize(files: list[Path], out: Path) -> Path:
    """Both views of `files` into `out` (text); `out`."""
    out.write_text(f"# {len(files)} profile(s): {', '.join(f.name for f in files)}\n\n## by own time\n"
                   + top(files) + "\n## by cumulative time\n" + top(files, cum=True))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--cum", action="store_true", help="by cumulative time (default: own time)")
    ap.add_argument("--top", type=int, default=TOP)
    args = ap.parse_args()
    print(top(args.profiles, cum=args.cum, nodes=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
