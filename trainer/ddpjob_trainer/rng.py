"""Capture and restore every RNG a rank uses, in a form torch.load(weights_only=True) accepts."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_state() -> dict[str, Any]:
    """This process's RNG states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind,
                  "keys": torch.from_numpy(keys.astype(np.int64)),  # type: ignore[attr-defined,unused-ignore]  # numpy's stub
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_state(state: dict[str, Any]) -> None:
    """Restore what get_state captured."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
