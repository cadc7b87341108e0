"""The network rule for tests: traffic goes to loopback, or to pods in network namespaces this
test run created (the real nodes' bridges) — never to the fictitious addresses of kwok's
simulated pods and nodes, which belong to no host here (a connection attempt to one leaves the
machine by its default route).

An operator started against kwok pods must therefore scrape a loopback URL. This module gives
the fixtures that default (`NO_SCRAPE_TEMPLATE`, a closed loopback port: every scrape fails at
once), the check that refuses an operator command line/environment without it
(`check_operator_scrape`), and a watcher of this machine's TCP table that catches any process of
this test run connecting to a fictitious address anyway (`ConnectionWatch`).
"""
from __future__ import annotations

import ipaddress
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

# hack/kwok-guard.sh is the one home of kwok's fictitious ranges (cluster-up gives them to kwok and
# rejects any connection to them while the cluster is up).
KWOK_GUARD = Path(__file__).resolve().parents[2] / "hack" / "kwok-guard.sh"


def _guard_range(var: str) -> ipaddress.IPv4Network:
    m = re.search(rf"^{var}=(\S+)", KWOK_GUARD.read_text(), re.M)
    if m is None:
        raise RuntimeError(f"{KWOK_GUARD} sets no {var}")
    return ipaddress.IPv4Network(m.group(1))


GUARD_CHAIN = re.search(r"^CHAIN=(\S+)", KWOK_GUARD.read_text(), re.M).group(1)  # type: ignore[union-attr]
# kwok pods' status.podIP (kwok's --cidr).
KWOK_POD_CIDR = _guard_range("KWOK_POD_CIDR")
# The InternalIP each kwok node gets (the API server would dial it for `kubectl logs`/`exec` on a
# kwok pod).
KWOK_NODE_CIDR = _guard_range("KWOK_NODE_CIDR")
FICTITIOUS_NETWORKS = (KWOK_POD_CIDR, KWOK_NODE_CIDR)

SCRAPE_ENV = "DDPJOB_SCRAPE_URL_TEMPLATE"
SCRAPE_FLAG = "--scrape-url-template"
# Port 9 (discard) is privileged and unused here: nothing answers, so a scrape fails at once
# (connection refused), and the path says why in the operator's log.
NO_SCRAPE_TEMPLATE = "http://127.0.0.1:9/kwok-pods-are-not-scraped/{namespace}/{pod}/metrics"
# What a kwok pod looks like to the scrape template (for rendering it in the check).
_KWOK_POD = {"pod": "job-1", "rank": 1, "ip": "10.244.0.7", "port": 9400, "rank_port": 9401,
             "namespace": "ns", "job": "job"}


class NetworkRuleError(AssertionError):
    """An operator would contact (or a process of this run contacted) a fictitious address."""


def effective_scrape_template(args: list[str], env: dict[str, str]) -> str:
    """The template `ddpjob operator ARGS` would use with this environment (click's rules: the
    last flag wins over the env var; empty means the default, the pod's own IP)."""
    value = env.get(SCRAPE_ENV, "")
    it = iter(args)
    for arg in it:
        if arg == SCRAPE_FLAG:
            value = next(it, "")
        elif arg.startswith(SCRAPE_FLAG + "="):
            value = arg.split("=", 1)[1]
    return value


def is_loopback_url(url: str) -> bool:
    """True when the URL's host is localhost or a loopback address (127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: it could resolve anywhere


def check_operator_scrape(args: list[str], env: dict[str, str], *, allow_pod_scrape: bool = False) -> str:
    """Raise NetworkRuleError unless `ddpjob operator ARGS` (with `env`) scrapes a loopback URL;
    returns the template. `allow_pod_scrape=True` is for operators watching real pods only (the
    real-node tier), whose addresses live in network namespaces this run created."""
    template = effective_scrape_template(args, env)
    if allow_pod_scrape:
        return template
    rule = (f"operators started by tests against kwok pods must scrape loopback: pass "
            f"{SCRAPE_FLAG} or set {SCRAPE_ENV} (tests/support/network.py NO_SCRAPE_TEMPLATE), "
            "or opt in with allow_pod_scrape=True for real pods only (docs/development.md, Network rule)")
    if not template:
        raise NetworkRuleError(f"the operator would scrape kwok pods at their own fictitious IPs "
                               f"(no {SCRAPE_FLAG}, {SCRAPE_ENV} unset or empty); {rule}")
    try:
        url = template.format(**_KWOK_POD)
    except (KeyError, IndexError, ValueError) as exc:
        raise NetworkRuleError(f"scrape template {template!r} does not render ({exc!r}); {rule}") from None
    if not is_loopback_url(url):
        raise NetworkRuleError(f"scrape template {template!r} targets {urlsplit(url).hostname!r}, "
                               f"not loopback; {rule}")
    return template


def with_loopback_scrape(env: dict[str, str]) -> dict[str, str]:
    """`env` with NO_SCRAPE_TEMPLATE unless it already names a template (an empty one counts as none)."""
    env = dict(env)
    if not env.get(SCRAPE_ENV):
        env[SCRAPE_ENV] = NO_SCRAPE_TEMPLATE
    return env


def helm_loopback_values() -> dict:
    """Chart values that point the in-cluster operator's scraper at loopback (the chart has no
    key of its own for the template; operator.extraEnv carries it)."""
    return {"operator": {"extraEnv": [{"name": SCRAPE_ENV, "value": NO_SCRAPE_TEMPLATE}]}}


def check_operator_container(container: dict, *, where: str) -> None:
    """check_operator_scrape for a Deployment/StatefulSet container running `ddpjob operator`."""
    args = list(container.get("args") or [])
    if args[:1] == ["operator"]:
        args = args[1:]
    env = {e["name"]: e.get("value", "") for e in container.get("env") or [] if "name" in e}
    try:
        check_operator_scrape(args, env)
    except NetworkRuleError as exc:
        raise NetworkRuleError(f"{where}: {exc}") from None


# --- watching the TCP table ------------------------------------------------------------------

_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
               "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
               "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def _hex_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True)
class TcpEntry:
    """One socket of /proc/net/tcp{,6}."""

    remote: ipaddress.IPv4Address | ipaddress.IPv6Address
    remote_port: int
    state: str
    inode: int


def parse_proc_net_tcp(text: str) -> list[TcpEntry]:
    """The sockets in the text of /proc/net/tcp or /proc/net/tcp6 (the header line skipped)."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        host, port = f[2].split(":")
        out.append(TcpEntry(_hex_address(host), int(port, 16), _TCP_STATES.get(f[3], f[3]), int(f[9])))
    return out


def _socket_owners(inodes: set[int], pids: list[int]) -> dict[int, int]:
    """inode -> pid, among `pids`, for the sockets in `inodes`."""
    owners: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", link)
            if m and int(m.group(1)) in inodes:
                owners[int(m.group(1))] = pid
    return owners


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


class ConnectionWatch:
    """Samples this machine's TCP table in a thread; records every socket of this process or
    one of its descendants whose remote address lies in `networks` (a SYN_SENT lasts until the
    connect times out, so sampling every `interval` seconds sees a scrape attempt).

    Sockets of other processes (other people's runs on a shared machine) are not ours to judge.
    Without /proc (not Linux) it records nothing.
    """

    def __init__(self, networks=FICTITIOUS_NETWORKS, *, interval: float = 0.1, root: int | None = None) -> None:
        self.networks = tuple(ipaddress.ip_network(n) for n in networks)
        self.interval = interval
        self.root = root or os.getpid()
        self._judged: set[int] = set()  # socket inodes looked at once (ours or not)
        self._found: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _forbidden(self, addr) -> bool:
        return any(addr.version == n.version and addr in n for n in self.networks)

    def sample(self) -> None:
        """Look once."""
        hits: dict[int, TcpEntry] = {}
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                text = Path(name).read_text()
            except OSError:
                continue
            for e in parse_proc_net_tcp(text):
                if self._forbidden(e.remote) and e.inode and e.inode not in self._judged:
                    hits[e.inode] = e
        if not hits:
            return
        import psutil

        ours = [self.root, *(p.pid for p in psutil.Process(self.root).children(recursive=True))]
        owners = _socket_owners(set(hits), ours)
        self._judged.update(hits)
        with self._lock:
            for inode, pid in owners.items():
                e = hits[inode]
                self._found.append(f"pid {pid} ({_cmdline(pid)}) -> {e.remote}:{e.remote_port} [{e.state}]")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001  (a watcher must not die of a /proc race)
                print(f"ConnectionWatch: sample failed: {exc!r}", file=sys.stderr)

    def start(self) -> "ConnectionWatch":
        self._thread = threading.Thread(target=self._loop, name="ConnectionWatch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def take(self) -> list[str]:
        """Sockets recorded since the last take() (each is reported once)."""
        with self._lock:
            found, self._found = self._found, []
        return found

    def check(self, *, what: str) -> None:
        """take(), raising NetworkRuleError naming the sockets when there are any."""
        hits = self.take()
        if hits:
            raise NetworkRuleError(f"{what} contacted fictitious kwok addresses ({', '.join(map(str, self.networks))}); "
                                   "tests may only reach loopback or pods of networks they created "
                                   "(docs/development.md, Network rule):\n  " + "\n  ".join(hits))


def block_in_process_connects(networks=FICTITIOUS_NETWORKS) -> None:
    """An audit hook: any socket.connect of THIS process to `networks` raises before a packet
    leaves (an in-process operator or scraper; subprocesses are ConnectionWatch's job)."""
    nets = tuple(ipaddress.ip_network(n) for n in networks)

    def hook(event: str, args: tuple) -> None:
        if event != "socket.connect":
            return
        address = args[1]
        if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
            return
        try:
            ip = ipaddress.ip_address(address[0].split("%")[0])
        except ValueError:
            return  # a name: resolved (and audited) by getaddrinfo's own connect later
        if any(ip.version == n.version and ip in n for n in nets):
            raise NetworkRuleError(f"this test process tried to connect to {address[0]}:{address[1]}, a "
                                   "fictitious kwok address (docs/development.md, Network rule)")

    sys.addaudithook(hook)


# Connections to kwok's ranges made on purpose: the guard's own test proves that they are refused.
# Every other rejected packet is an attempt that must not have happened. The guard is one iptables
# chain for the whole machine, and pytest sessions can run side by side (make test runs the cluster
# tiers beside the CPU tiers), so the probes are counted where every session sees them: a ledger file,
# one line per probe, written before the probe's packet leaves. A session compares the growth of the
# guard's counters with the growth of this ledger over its own lifetime.
GUARD_PROBE_LEDGER = Path(os.environ.get("DDPJOB_GUARD_PROBE_LEDGER", "/tmp/ddpjob-kwok-guard-probes"))


def record_guard_probe() -> None:
    with GUARD_PROBE_LEDGER.open("a") as ledger:   # O_APPEND: one write per line, atomic among sessions
        ledger.write(f"{os.getpid()}\n")


def guard_probes() -> int:
    """Deliberate probes so far, by every session on this machine."""
    try:
        return GUARD_PROBE_LEDGER.read_text().count("\n")
    except FileNotFoundError:
        return 0


def guard_rejections() -> int | None:
    """Packets the guard rejected since it was set up (`hack/kwok-guard.sh count`); None when it is
    not set up (no cluster, or not root)."""
    import subprocess

    proc = subprocess.run([str(KWOK_GUARD), "count"], capture_output=True, text=True, timeout=60)
    return int(proc.stdout) if proc.returncode == 0 and proc.stdout.strip().isdigit() else None
