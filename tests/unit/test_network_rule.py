"""The network rule's guards (tests/support/network.py): operators that tests start against kwok
pods scrape loopback by default, a command line that would scrape pod IPs is refused, and the
TCP-table watcher really sees a process of this run connecting to a watched network."""
from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.support.cluster import REPO_ROOT, Cluster
from tests.support.network import (
    KWOK_NODE_CIDR,
    KWOK_POD_CIDR,
    NO_SCRAPE_TEMPLATE,
    SCRAPE_ENV,
    ConnectionWatch,
    NetworkRuleError,
    block_in_process_connects,
    check_operator_container,
    check_operator_scrape,
    effective_scrape_template,
    helm_loopback_values,
    parse_proc_net_tcp,
)

POD_IP_TEMPLATE = "http://{ip}:{port}/metrics"


@pytest.mark.parametrize("args, env", [
    ([], {}),
    ([], {SCRAPE_ENV: ""}),
    (["--scrape-url-template", POD_IP_TEMPLATE], {}),
    ([f"--scrape-url-template={POD_IP_TEMPLATE}"], {SCRAPE_ENV: NO_SCRAPE_TEMPLATE}),  # the flag wins
    (["--scrape-url-template", "http://{pod}.{job}.{namespace}.svc:{port}/metrics"], {}),
    (["--scrape-url-template", "http://10.244.0.9:{rank_port}/metrics"], {}),
    (["--scrape-url-template", "http://127.0.0.1:{nope}/metrics"], {}),
])
def test_an_operator_that_would_scrape_kwok_pods_is_refused(args, env):
    with pytest.raises(NetworkRuleError, match="must scrape loopback"):
        check_operator_scrape(["-n", "ns", *args], env)


@pytest.mark.parametrize("args, env", [
    ([], {SCRAPE_ENV: NO_SCRAPE_TEMPLATE}),
    (["--scrape-url-template", "http://127.0.0.1:{rank_port}/metrics"], {}),
    (["--scrape-url-template=http://localhost:9400/m"], {SCRAPE_ENV: POD_IP_TEMPLATE}),
])
def test_loopback_templates_pass(args, env):
    check_operator_scrape(["-n", "ns", *args], env)


def test_pod_scraping_needs_an_explicit_opt_in():
    assert check_operator_scrape([], {}, allow_pod_scrape=True) == ""


@pytest.mark.parametrize("args, env", [
    ([], {SCRAPE_ENV: "from-env"}),
    (["--scrape-url-template", "flag"], {SCRAPE_ENV: "from-env"}),
    (["--scrape-url-template=a", "--scrape-url-template", "b"], {}),
    (["-n", "x"], {}),
])
def test_the_effective_template_is_what_the_real_cli_parses(monkeypatch, args, env):
    from ddpjob_cli import main as cli

    monkeypatch.delenv(SCRAPE_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = cli.main.commands["operator"].make_context("operator", list(args))
    assert effective_scrape_template(args, env) == ctx.params["scrape_url_template"]


def test_cluster_env_gives_operators_a_loopback_template_by_default(monkeypatch, tmp_path):
    c = Cluster(kubeconfig=tmp_path / "kubeconfig", bin_dir=tmp_path)
    monkeypatch.setenv(SCRAPE_ENV, "")  # an empty one in the developer's shell means "pod IPs"
    assert c.env()[SCRAPE_ENV] == NO_SCRAPE_TEMPLATE
    assert c.env(**{SCRAPE_ENV: "http://127.0.0.1:{rank_port}/metrics"})[SCRAPE_ENV].startswith("http://127.")
    with pytest.raises(NetworkRuleError, match="not loopback"):
        c.env(**{SCRAPE_ENV: "http://10.244.1.2:9400/metrics"})
    assert c.env(allow_pod_scrape=True)[SCRAPE_ENV] == ""


def test_e2e_operator_command_scrapes_loopback_and_refuses_pod_ips(tmp_path):
    from tests.e2e import conftest as e2e

    cmd, env = e2e.operator_command(tmp_path / "kc", "-n", "ns", health=1, metrics=2)
    assert check_operator_scrape(cmd[cmd.index("operator") + 1:], env) == NO_SCRAPE_TEMPLATE
    with pytest.raises(NetworkRuleError):
        e2e.operator_command(tmp_path / "kc", "-n", "ns", f"--scrape-url-template={POD_IP_TEMPLATE}",
                             health=1, metrics=2)


def test_the_chart_installed_with_the_loopback_values_passes_the_workload_check(tmp_path):
    chart = pytest.importorskip("tests.unit.test_chart")
    if chart.HELM is None:
        pytest.skip("no helm binary")
    c = chart.container(chart.render(values=helm_loopback_values(), tmp_path=tmp_path))
    check_operator_container(c, where="chart")
    with pytest.raises(NetworkRuleError, match="chart"):  # the chart's own default scrapes pod IPs
        check_operator_container(chart.container(chart.render()), where="chart")


def test_kwok_addresses_and_real_node_subnets_cannot_overlap():
    up = (REPO_ROOT / "hack" / "cluster-up.sh").read_text()
    # cluster-up takes both ranges from the guard (one home), for kwok and for the nodes it makes.
    assert '--cidr "$KWOK_POD_CIDR"' in up and "address: ${KWOK_NODE_CIDR%.*/*}." in up
    ranges = subprocess.run([str(REPO_ROOT / "hack" / "kwok-guard.sh"), "ranges"], capture_output=True,
                            text=True, check=True).stdout.split()
    assert [ipaddress.ip_network(r) for r in ranges] == [KWOK_POD_CIDR, KWOK_NODE_CIDR]
    real = ipaddress.ip_network(re.search(r"^POD_RANGE=(\S+)", (REPO_ROOT / "hack" / "nodes-lib.sh")
                                          .read_text(), re.M).group(1))
    assert not real.overlaps(KWOK_POD_CIDR) and not real.overlaps(KWOK_NODE_CIDR)


def test_proc_net_tcp_lines_are_decoded():
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:A1B2 0700F40A:24C0 02 00000000:00000000 01:00000066 00000002     0        0 4242 1\n")
    (e,) = parse_proc_net_tcp(text)
    assert (str(e.remote), e.remote_port, e.state, e.inode) == ("10.244.0.7", 9408, "SYN_SENT", 4242)
    v6 = ("  sl  local_address                         remote_address                        st\n"
          "   0: 00000000000000000000000001000000:0050 0000000000000000FFFF00000700F40A:24C0 01 "
          "00000000:00000000 00:00000000 00000000     0        0 77 1\n")
    (e6,) = parse_proc_net_tcp(v6)
    assert str(e6.remote) == "10.244.0.7" and e6.state == "ESTABLISHED"


def test_the_watch_sees_a_child_process_connecting_to_a_watched_network():
    # 127.77.0.0/16 stands in for the kwok ranges: loopback, so the test itself obeys the rule.
    with socket.socket() as srv:
        srv.bind(("127.77.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        watch = ConnectionWatch(["127.77.0.0/16"], interval=0.05).start()
        child = subprocess.Popen([sys.executable, "-c",
                                  f"import socket, time; s = socket.create_connection(('127.77.0.1', {port})); "
                                  "time.sleep(30)"])
        try:
            deadline = time.monotonic() + 30
            hits: list[str] = []
            while not hits and time.monotonic() < deadline:
                time.sleep(0.1)
                hits = watch.take()
        finally:
            child.kill()
            child.wait()
            watch.stop()
    assert hits and f"pid {child.pid}" in hits[0] and f"127.77.0.1:{port}" in hits[0], hits
    watch.sample()
    watch.check(what="nothing new")  # each socket is reported once


def test_the_watch_ignores_loopback_outside_the_watched_networks():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        watch = ConnectionWatch(["127.77.0.0/16"])
        with socket.create_connection(srv.getsockname()):
            watch.sample()
    assert watch.take() == []


def test_this_process_cannot_connect_to_a_blocked_network():
    block_in_process_connects(["127.78.0.0/16"])  # audit hooks stay for the session: a range no one uses
    with socket.socket() as s, pytest.raises(NetworkRuleError, match="127.78.0.1"):
        s.connect(("127.78.0.1", 9))
