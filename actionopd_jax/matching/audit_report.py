"""The matcher audit's outputs in the run directory: audit.json (everything measured),
audit.md (the same, for a reader, with the estimators stated) and a link section in report.md
(refreshed, never duplicated; experiment/report.py adds it when it rewrites report.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

AUDIT_MD = "audit.md"
AUDIT_JSON = "audit.json"
_BEGIN, _END = "<!-- matcher-audit -->", "<!-- /matcher-audit -->"


def report_link_section() -> str:
    return "\n".join([_BEGIN, "## Matcher audit", "",
                      f"How often the LLM judge is wrong, measured by a second judge: [{AUDIT_MD}]({AUDIT_MD}) "
                      f"(numbers: [{AUDIT_JSON}]({AUDIT_JSON}); `actionopd audit-matcher` writes both).", _END, ""])


def link_from_report(run_dir: Path) -> bool:
    """Add (or refresh) the audit section of run_dir/report.md; False when there is no report.md."""
    path = Path(run_dir) / "report.md"
    if not path.exists():
        return False
    text = path.read_text()
    if _BEGIN in text and _END in text:
        head, rest = text.split(_BEGIN, 1)
        text = head + rest.split(_END, 1)[1].lstrip("\n")
    path.write_text(text.rstrip("\n") + "\n\n" + report_link_section())
    return True


def _pct(v: Any) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _action(a: dict[str, Any]) -> str:
    text = json.dumps(a.get("arguments"), ensure_ascii=False, sort_keys=True) if a["kind"] == "tool_call" else \
        json.dumps(a.get("text"), ensure_ascii=False)
    head = f"{a['name']}({text})" if a["kind"] == "tool_call" else f"message {text}"
    return head if len(head) <= 300 else head[:297] + "..."


def render_markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    jj, rules, flips, ex = s["judge_vs_judge"], s["rules"], s["flips"], s.get("execution", {})
    log, ask = doc["log"], doc["audit_judge"]["requests"]
    md = ["# Matcher audit", "",
          f"Run's judge: {doc['run_judge']}. Audit judge: `{doc['audit_judge']['model']}` at "
          f"{doc['audit_judge']['base_url']} ({doc['audit_judge']['provider']}), asked the matcher's own question "
          f"(prompt {doc['audit_judge']['prompt_version']}).", "",
          f"Judged-pair log: {log['files']} file(s), {log['states']} state groups, {s['definite_pairs']} pairs with a "
          f"definite verdict ({log['skipped_lines']} unreadable line(s), {log['duplicates']} re-collected "
          f"state(s), the last kept; {log['missing_context']} sampled state(s) without their context, their pairs "
          f"not asked). Sample: {doc['sample']['requested']} pairs requested, seed {doc['sample']['seed']}; "
          f"{ask['questions']} distinct questions, {ask['cached']} answered from the audit cache, {ask['asked']} "
          f"asked, {ask['unavailable']} without a verdict (left out below; a re-run asks them again).", "",
          "## Strata", "",
          "| stratum | pairs | sampled | answered | disagreements | rate |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {name} | {r['population']} | {r['sampled']} | {r['answered']} | {r['disagreements']} "
           f"| {_pct(r['rate'])} |" for name, r in s["strata"].items()]
    t = jj["sample_table"]
    md += ["", "`judge/*`: decided by the run's LLM judge. `rules/*`: decided by the rules alone (same tool and "
           "canonically equal arguments, or equal normalized messages: match; different tools: no match); there a "
           "disagreement is an error of the audit judge on a case with a known answer.", "",
           "## The two judges (judge strata)", "",
           "| run's judge \\ audit judge | match | no_match |", "|---|---:|---:|",
           f"| match | {t[0][0]} | {t[0][1]} |", f"| no_match | {t[1][0]} | {t[1][1]} |", "",
           f"- agreement {_pct(jj['agreement'])}, Cohen's kappa {_num(jj['kappa'])} (population estimate: each sampled "
           f"pair weighted by its stratum's pairs / answered pairs); on the plain sample counts above: agreement "
           f"{_pct(jj['sample_agreement'])}, kappa {_num(jj['sample_kappa'])}",
           f"- run's judge match, audit judge no_match: {_pct(jj['run_match_audit_no_match'])} of the run's "
           "judged matches",
           f"- run's judge no_match, audit judge match: {_pct(jj['run_no_match_audit_match'])} of the run's "
           "judged non-matches",
           "", "## Judge against the rules", "",
           f"- judge no_match where the rules match: {_pct(rules['judge_no_match_where_rules_match'])}",
           "- judge match where the rules say no match (different tools): "
           f"{_pct(rules['judge_match_where_rules_no_match'])}",
           "", "## Execution against the audit judge", "",
           f"- pairs decided by running both calls on forks of the state: {ex.get('pairs', 0)}; the audit judge "
           f"disagrees on {_pct(ex.get('disagreement'))} of them (population estimate)",
           f"- execution match, audit judge no_match: {_pct(ex.get('audit_no_match_where_execution_match'))}; "
           f"execution no_match, audit judge match: {_pct(ex.get('audit_match_where_execution_no_match'))}",
           "", "## Rewards that would flip", "",
           f"- pair verdicts: {_pct(flips['pair_verdicts'])} of all {s['definite_pairs']} definite pair verdicts",
           f"- candidate rewards: {_pct(flips['candidate_rewards'])} of {flips['candidates']} candidates in groups "
           "without an unavailable verdict", "",
           "Estimators: d_s is the disagreement rate among stratum s's answered sampled pairs, N_s its number of "
           "pairs. Pair verdicts: sum over the judge strata of N_s d_s, divided by all pairs with a definite verdict "
           "(pairs the rules decide never reach a judge during training, so they cannot flip). Candidate rewards: "
           "the mean over candidates of 1 - prod_k (1 - d_{s(i,k)}), d = 0 for rules-decided pairs: a candidate's "
           "reward r_lambda changes when any of its K verdicts flips, the flips taken as independent. 'Flip' means "
           "the audit judge's verdict in place of the run's judge's; which of the two is right is not known."]
    if flips["judge_strata_without_answers"]:
        md += ["", "Judge strata with no answered sample (counted as 0 above): "
               f"{', '.join(flips['judge_strata_without_answers'])}."]
    md += ["", "## Most common disagreement patterns", ""]
    if not s["patterns"]:
        md += ["No disagreements in the sample."]
    for p in s["patterns"]:
        md += [f"- **{p['pattern']}** ({p['count']})"]
        md += [f"  - {e['task_id']} step {e['step']} decision {e['decision']}: candidate {_action(e['candidate'])} / "
               f"teacher {_action(e['teacher'])}" for e in p["examples"]]
    md += ["", f"Every disagreement, with its state: `{AUDIT_JSON}` (`summary.disagreements`).", ""]
    return "\n".join(md)


def write_audit(run_dir: Path, doc: dict[str, Any]) -> dict[str, Path]:
    run_dir = Path(run_dir)
    paths = {"json": run_dir / AUDIT_JSON, "markdown": run_dir / AUDIT_MD}
    paths["json"].write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    paths["markdown"].write_text(render_markdown(doc))
    if link_from_report(run_dir):
        paths["report"] = run_dir / "report.md"
    return paths
