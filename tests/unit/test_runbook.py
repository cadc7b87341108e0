"""docs/runbook.md: one section per alert of the chart's rules, each linked by the alert's runbook_url
and saying what the alert means, what to check and what to do."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "charts" / "ddpjob-operator" / "rules" / "ddpjob-alerts.yaml"
RUNBOOK = REPO / "docs" / "runbook.md"
BASE = "https://github.com/ddpjob/ddpjob/blob/main/docs/runbook.md"
PARTS = ("**What it means.**", "**What to check.**", "**What to do.**")


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}


def sections() -> dict[str, str]:
    """Level-2 sections of the runbook by GitHub anchor (lower case; our headings are one word)."""
    parts = re.split(r"^## (.+)$", RUNBOOK.read_text(), flags=re.M)
    return {title.strip().lower(): body for title, body in zip(parts[1::2], parts[2::2])}


def test_every_alert_links_its_own_section():
    found = sections()
    for name, rule in alerts().items():
        url = rule["annotations"].get("runbook_url")
        assert url == f"{BASE}#{name.lower()}", name
        assert name.lower() in found, f"docs/runbook.md has no '## {name}'"


def test_every_section_is_an_alert_and_says_what_it_means_what_to_check_what_to_do():
    names = {n.lower() for n in alerts()}
    for anchor, body in sections().items():
        assert anchor in names, f"section {anchor!r} is no alert of {RULES.name}"
        positions = [body.find(p) for p in PARTS]
        assert -1 not in positions and positions == sorted(positions), f"{anchor}: needs {PARTS} in order"


def test_the_table_lists_every_alert_with_its_defaults():
    values = yaml.safe_load((RULES.parent.parent / "values.yaml").read_text())["monitoring"]["prometheusRule"]
    text = RUNBOOK.read_text()
    for name, a in values["alerts"].items():
        row = f"| [{name}](#{name.lower()}) | {a['severity']}, {a['for'] or 'none'} |"
        assert row in text, row
