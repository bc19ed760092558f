"""Scoring a BFCL multi-turn episode with the package's official checker.

`official` is the checker's verdict as the package's eval runner computes it (a run that was
force-terminated, with fewer turns than the ground truth, fails). `strict` also requires the
package's irrelevance check: on turns whose ground truth is empty (the right answer is to
call nothing), the agent must have made no successful call.

The checker re-executes call strings with `eval` and caches instances in its module globals
under a name built from the model name; every scoring call uses a fresh model name and removes
its globals afterwards, under a lock. Module-level data of `long_context.py` that the package's
classes can mutate is restored after each call.
"""

from __future__ import annotations

import copy
import threading
import uuid
from typing import Any

_LOCK = threading.Lock()


def _protected_module_data() -> dict[int, tuple[Any, Any]]:
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

    saved = {}
    for name, value in vars(long_context).items():
        if name.isupper() and isinstance(value, (dict, list)):
            saved[id(value)] = (value, copy.deepcopy(value))
    return saved


def _restore(saved: dict[int, tuple[Any, Any]]) -> None:
    for live, snapshot in saved.values():
        if isinstance(live, dict):
            live.clear()
            live.update(snapshot)
        else:
            live[:] = snapshot


def score_bfcl(entry: dict, decoded_turns: list[list[list[str]]], ground_truth: list[list[str]]) -> dict[str, Any]:
    """`decoded_turns[t]` = the call strings of each tool-call step of turn t (one call per
    step for our agents). Returns official/strict verdicts and the checker's error, if any."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
        multi_turn_checker,
        multi_turn_irrelevance_checker,
    )

    test_category = entry["id"].rsplit("_", 1)[0]
    if len(decoded_turns) != len(ground_truth):
        result = {
            "valid": False,
            "error_type": "multi_turn:force_terminated",
            "error_message": f"episode has {len(decoded_turns)} of {len(ground_truth)} turns",
        }
        return _verdict(result, {"valid": False})
    model_name = f"actionopd_{uuid.uuid4().hex}"
    with _LOCK:
        saved = _protected_module_data()
        try:
            checker_entry = copy.deepcopy(entry)
            checker_entry.pop("function", None)
            result = multi_turn_checker(
                copy.deepcopy(decoded_turns), copy.deepcopy(ground_truth), checker_entry, test_category, model_name
            )
        except Exception as exc:  # a checker crash is a failed verdict, with the reason kept
            result = {"valid": False, "error_type": "checker_error", "error_message": f"{type(exc).__name__}: {exc}"}
        finally:
            stale = [k for k in vars(multi_turn_utils) if k.startswith(model_name)]
            for key in stale:
                delattr(multi_turn_utils, key)
            _restore(saved)
    irrelevance = multi_turn_irrelevance_checker(decoded_turns, ground_truth)
    return _verdict(result, irrelevance)


def _verdict(official: dict, irrelevance: dict) -> dict[str, Any]:
    ok = bool(official.get("valid"))
    strict = ok and bool(irrelevance.get("valid"))
    out: dict[str, Any] = {"official": float(ok), "strict": float(strict), "reward": float(ok)}
    if not ok:
        out["error_type"] = official.get("error_type", "")
        out["error_message"] = str(official.get("error_message", ""))[:500]
    elif not strict:
        out["error_type"] = irrelevance.get("error_type", "")
        out["error_message"] = str(irrelevance.get("error_message", ""))[:500]
    return out
