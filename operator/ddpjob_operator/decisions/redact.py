"""Secrets out of text the operator copies into status and events (pure).

Whoever may read a DDPJob (its status, its events) is often not whoever may read its pods'
logs or secrets, so container output copied there must not carry credentials: URL userinfo,
Authorization headers, `password=...`-style pairs, and tokens whose shape gives them away.
"""
from __future__ import annotations

import re

MASK = "***"
_RULES: list[tuple[re.Pattern, str]] = [
    # scheme://user:password@host, scheme://token@host -> scheme://***@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@:]*(?::[^/\s@]*)?@"), rf"\1{MASK}@"),
    # Authorization: Bearer xyz / Basic xyz
    (re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{8,}"), rf"\1 {MASK}"),
    # password=..., api_key: ..., "secret": "..." (the key names the secret; keep the key)
    (re.compile(r"(?i)([\"']?\b[\w.-]*(?:passw(?:or)?d|pwd|secret|token|api[_-]?key|access[_-]?key|"
                r"private[_-]?key|credentials?|auth)[\w.-]*[\"']?\s*[:=]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&\"']+)"),
     rf"\1{MASK}"),
    # Tokens recognisable by shape: JWTs, AWS access key ids, GitHub/GitLab/Hugging Face/Slack/OpenAI.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"), MASK),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}|"
                r"hf_[A-Za-z0-9]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|sk-[A-Za-z0-9_-]{20,})\b"), MASK),
]


def redact(text: str) -> str:
    """`text` with credentials replaced by ***."""
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    return text
