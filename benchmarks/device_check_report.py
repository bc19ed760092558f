"""The device check's report (benchmarks/device_check.py): the ratios against the ceilings
(measured in the run, else the device's published figures) and the markdown tables. Stdlib
only: the parent process that writes it never imports jax, and device_check_work.py reads the
published figures from here."""

from __future__ import annotations

# published per-chip figures (dense bf16 FLOP/s, HBM bytes/s), matched on jax's device_kind:
# reported beside the measured ceilings, and used for the ratios only where none was measured
PEAKS = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.039e12),
         ("L4", 121e12, 0.3e12), ("TPU v5p", 459e12, 2.765e12), ("TPU v5 lite", 197e12, 0.819e12),
         ("TPU v5e", 197e12, 0.819e12), ("TPU v6", 918e12, 1.64e12), ("TPU v4", 275e12, 1.2e12))


# How TFLOP/s and MFU count a step (train/aot_check.model_flops), as MaxText counts them:
# model FLOPs, forward + backward = 3 x forward, no remat recompute, per chip.
FLOPS_NOTE = ("TFLOP/s per chip = model FLOPs / step s / chips, model FLOPs per row = 6 x N x T + "
              "12 x L x H x Dh x T^2/2 + 6 x D x V x R (N non-embedding parameters, T tokens, L layers, H query "
              "heads of Dh, causal: T^2/2 pairs; the LM head D x V on the R response tokens that have logits); "
              "no remat recompute, as MaxText counts it")


def apply_ceilings(rep: dict) -> None:
    """MFU and the fraction of the HBM bound, against the ceilings measured in this run (else
    the device's published figures, else none), the source named in `rep["ceilings_used"]`."""
    measured = [c for c in rep.get("ceilings", []) if c.get("ok")]
    devices = rep.get("devices") or [{}]
    flops = bw = None
    source = "none"
    if measured:
        flops, bw, source = measured[0]["matmul_flops_per_s"], measured[0]["copy_bytes_per_s"], "measured"
    else:
        flops, bw = published_peaks(devices[0].get("kind", ""))
        if flops is not None:
            source = "published (no ceilings measured in this run)"
    rep["ceilings_used"] = {"flops_per_s": flops, "bytes_per_s": bw, "source": source}
    n = max(1, len(devices))
    for t in rep.get("train_step", []):
        if "step_s" in t:
            t["mfu"] = None if flops is None else round(t["model_flops"] / (t["step_s"] * flops * n), 4)
    for k in rep.get("attention_kernels", []):   # the bound's bytes over the call's time, against the copy's
        if "s" in k:
            k["fraction_of_copy"] = None if bw is None else round(k["kv_bytes"] / k["s"] / bw, 4)
    for d in rep.get("decode", []):
        if "tokens_per_s" in d:
            bound = None if bw is None else d["rows"] * bw / (d["weight_bytes"] + d["kv_bytes_mean"])
            d["hbm_bound_tokens_per_s"] = None if bound is None else round(bound, 1)
            d["fraction_of_bound"] = None if bound is None else round(d["tokens_per_s"] / bound, 4)


def published_peaks(kind: str) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, HBM bytes/s) published for a jax device_kind: the first PEAKS row it names."""
    for name, flops, bw in PEAKS:
        if name.lower() in kind.lower():
            return flops, bw
    return None, None


def _fmt(x, spec="{:.3g}"):
    return "-" if x is None else spec.format(x)


def _ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def _shapes_lines(sh: dict | None) -> list[str]:
    """Which memory figure chose the shapes (device_check_shapes.choose), and what it left out."""
    if not sh:
        return []
    gib = 1024 ** 3
    if not sh.get("memory_bytes"):
        return [f"shapes: {sh.get('source', 'the defaults')}"]
    train = ", ".join(f"{t['attention']} {t['seq']}{' ' + t['param_dtype'] + ' weights' if t['param_dtype'] else ''} "
                      f"{t['plan_bytes'] / gib:.1f}" for t in sh["train"])
    calls = ", ".join(f"{d['work']} {d['static_calls']}" for d in sh["decode"].values() if d["static_calls"] > 1)
    lines = [f"shapes planned for {sh['memory_bytes'] / gib:.1f} GiB ({sh['source']}), usable "
             f"{sh['usable_bytes'] / gib:.1f} GiB: train plans (GiB) {train or '-'}; engine pools "
             + ", ".join(f"{d['work']} {d['pool_pages']} pages" for d in sh["decode"].values())
             + (f"; static calls {calls}" if calls else "")]
    return lines + [f"not planned: {d['stage']}: {d['why']}" for d in sh.get("dropped", [])]


def _cache_line(rep: dict) -> list[str]:
    """The children's compilation cache and what the measurements loaded from it: a program
    loaded (an earlier stage's or call's) takes seconds, so a stage's compile figures are cold
    only where it loaded none."""
    if not rep.get("compile_cache"):
        return []
    if rep["compile_cache"] == "off":
        return ["compile cache: off (every program compiled cold)"]
    rows = [r for section in rep.values() if isinstance(section, list) for r in section if isinstance(r, dict)]
    stages = {r["stage"]: r["compile_cache"] for r in rows if isinstance(r.get("compile_cache"), dict) and r.get("stage")}
    loaded = sum(c["loaded"] for c in stages.values())
    compiled = sum(c["compiled"] for c in stages.values())
    return [f"compile cache: {rep['compile_cache']}; programs loaded {loaded}, compiled {compiled}"
            + (f" (loaded in: {', '.join(n for n, c in stages.items() if c['loaded'])})" if loaded else "")]


def _compile_s(t: dict) -> str:
    """A train row's compile seconds, "loaded" where its update came from the cache."""
    return f"{t['compile_s']}" + (" (loaded)" if (t.get("compile_cache") or {}).get("loaded") else "")


def markdown(rep: dict) -> str:
    """The report as tables, shortest last-read parts at the end (a device call returns only
    the end of its output)."""
    kinds = ", ".join(sorted({d["kind"] for d in rep["devices"]}))
    used = rep.get("ceilings_used", {})
    lines = [f"# device check ({rep['mode']}): {len(rep['devices'])} x {kinds}, jax {rep['jax']}", ""]
    for c in rep["ceilings"]:
        if "copy_bytes_per_s" in c:
            lines.append(f"ceilings (measured): copy {c['copy_bytes_per_s'] / 1e9:,.0f} GB/s, bf16 matmul "
                         f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s (n={c['matmul_n']})")
        else:
            lines.append(f"ceilings: FAILED: {c.get('error', '')}")
    lines += [f"ratios against: {used.get('source', 'none')}", *_shapes_lines(rep.get("shapes")), *_cache_line(rep), "",
              "| check | result | detail |", "| --- | --- | --- |"]
    for p in rep["parity"]:
        detail = (f"fwd rel err {_fmt(p.get('forward_rel_err'))}, grad {_fmt(p.get('grad_rel_err'))}"
                  if "forward_rel_err" in p else f"{p.get('rows_equal', '-')}/{p.get('rows', '-')} rows equal"
                  if "rows" in p else p.get("error", ""))
        lines.append(f"| {p['check']} | {'ok' if p['ok'] else 'FAILED'} | {detail} |")
    # issue 42: TFLOP/s per chip (>= 500), and `train --check`'s plan within 1.15x of the peak
    lines += ["", "| train step | attention | remat | rows x tokens | compile s | step s | tokens/s | TFLOP/s | MFU | "
              "peak GiB | plan GiB | plan / peak |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    gib = 1024 ** 3
    for t in rep["train_step"]:
        if "step_s" not in t:
            lines.append(f"| {t['check']} | FAILED: {t.get('error', '')} | | | | | | | | | | |")
            continue
        remat = t["remat"] + (f", {t['param_dtype']} weights" if t.get("param_dtype", "float32") != "float32" else "") \
            + (", layers unrolled" if t.get("scan_unroll") == 0 else "")
        attention = t["attention"] + (f", XLA_FLAGS={t['xla_flags']}" if t.get("xla_flags") else "")
        lines.append(f"| {t['model']} | {attention} | {remat} | {t['rows']} x {t['seq_len']} | "
                     f"{_compile_s(t)} | {t['step_s']} | {t['tokens_per_s']:,.0f} | "
                     f"{t['model_flops'] / (t['step_s'] * t.get('devices', 1)) / 1e12:.0f} | "
                     f"{_fmt(t.get('mfu'), '{:.1%}')} | {_fmt(t['peak_bytes'] and t['peak_bytes'] / gib, '{:.1f}')} | "
                     f"{t['plan_bytes'] / gib:.1f} | {_ratio(t['plan_bytes'], t['peak_bytes'])} |")
    if rep["train_step"]:
        lines += ["", FLOPS_NOTE]
    for t in rep["train_step"]:   # the remat choice, confirmed by XLA's compile against the device's limit
        if t.get("remat_compiled"):
            got = "; ".join(f"{c['policy']}: XLA " + (f"{c['xla_bytes'] / gib:.2f} GiB" if c["xla_bytes"] is not None
                                                      else f"did not compile ({c['error'][:80]})")
                            + f", planned {c['plan_bytes'] / gib:.2f}" for c in t["remat_compiled"])
            lines.append(f"- {t['model']} {t['attention']} {t['seq_len']}: remat compiled against the "
                         f"{t['bytes_limit'] / gib:.2f} GiB limit: {got}; ran {t['remat']}")
    lines += split_lines(rep["train_step"])
    # issue 41's goals: the engine's decode against the HBM bound; end to end (prefill + decode)
    # against static (>= 1.5x) and transformers (>= 3x)
    lines += ["", "| decode | sampler | rows | prompts + new | decode tok/s | of HBM bound | end-to-end tok/s | "
              "vs static, decode / end to end | vs transformers, end to end |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = _measured_decodes(rep)
    for d in rep["decode"]:
        if "tokens_per_s" not in d:
            lines.append(f"| {d['check']} | FAILED: {d.get('error', '')} | | | | | | | |")
            continue
        clean = d.get("ok", True)   # an unclean row (listed below the table) is compared with nothing
        static = by.get((d["model"], "static", d["rows"]), {}) if clean else {}
        hf = by.get((d["model"], "transformers", d["rows"]), {}) if clean else {}
        lines.append(f"| {d['model']} | {d['sampler']} | {d['rows']} | {d['prompt_lens'][0]}-{d['prompt_lens'][1]} + "
                     f"{d['max_new']} | {d['tokens_per_s']:,.0f} | {_fmt(d.get('fraction_of_bound'), '{:.1%}')} | "
                     f"{d['end_to_end_tokens_per_s']:,.0f} | "
                     + (f"{_ratio(d['tokens_per_s'], static.get('tokens_per_s'))} / "
                        f"{_ratio(d['end_to_end_tokens_per_s'], static.get('end_to_end_tokens_per_s'))} | "
                        if d["sampler"] == "engine" else "- | ") +
                     f"{_ratio(d['end_to_end_tokens_per_s'], hf.get('end_to_end_tokens_per_s')) if d['sampler'] != 'transformers' else '-'} |")
    unclean = [d for d in rep["decode"] if "tokens_per_s" in d and not d.get("ok", True)]
    torch_rows = [d for d in rep["decode"] if d.get("sampler") == "transformers" and "setting" in d]
    lines += [""] if torch_rows or unclean else []
    for d in unclean:   # timed, but not a timing of the workload: left out of the ratios and goals
        lines.append(f"- {d['model']} {d['sampler']} {d['rows']} rows: FAILED, not a clean timing ({_unclean(d)}); "
                     "left out of the ratios and the goals")
    for d in torch_rows:
        lines.append(f"- transformers {d['model']} {d['rows']} rows: {d['setting']} (compiled: "
                     f"{'yes' if d['compiled'] else 'no'}), {d['attention']} attention, {d['calls']} call(s) of "
                     f"{d['prompts_per_call']} prompts" + (f"; not run: {'; '.join(d['setting_errors'])}"
                                                          if d["setting_errors"] else ""))
    lines += engine_split_lines(rep.get("decode_split", [])) + kernel_lines(rep.get("attention_kernels", []))
    if rep["mode"] == "device":
        lines += ["", "| goal | verdict |", "| --- | --- |"] + [f"| {g} | {v} |" for g, v in goals(rep)]
    if rep["timed_out"]:
        lines += ["", "timed out (killed at their time limit): " + ", ".join(rep["timed_out"])]
    if rep["skipped"]:
        lines += ["", "skipped (time budget): " + ", ".join(rep["skipped"]),
                  f"run them: --only '{','.join(rep['skipped'])}'"]
    lines += [f"error: {e}" for e in rep["errors"]]
    lines += ["", f"install: {rep['install']['command'] or '-'} ({rep['install']['skipped'] or str(rep['install']['seconds']) + ' s'}); "
              f"elapsed {rep['elapsed_s']} s; {'ALL OK' if rep['ok'] else 'SOME CHECK FAILED'}"]
    return "\n".join(lines) + "\n"


def split_lines(train_rows: list[dict]) -> list[str]:
    """The profiled train step's time by kind (train/time_split.py), largest first."""
    lines = []
    for t in train_rows:
        sp = t.get("split")
        if not sp:
            continue
        head = f"{t['model']} {t['attention']} {t['rows']} x {t['seq_len']}, remat {t['remat']}"
        if "categories" not in sp or not sp.get("ops"):
            lines += ["", f"time split of the {head} step: not available ({sp.get('error') or sp.get('note', '')})"]
            continue
        total = sp["ops_s"] or 1.0
        lines += ["", f"time split of the {head} step (profiled once, command buffers {sp['command_buffers']}: "
                      f"{sp['profiled_step_s']} s a step; op time summed on the {sp['tracks']}'s tracks)", "",
                  "| kind | ms per step | share of op time |", "| --- | --- | --- |"]
        for kind, s in sorted(sp["categories"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {kind} | {s * 1e3:,.2f} | {s / total:.1%} |")
        lines.append("largest ops: " + ", ".join(f"{o['op']} ({o['kind']}, {o['s'] * 1e3:,.2f} ms)"
                                                  for o in sp["top"][:3]))
        lines += _without_optimizer(t, sp["categories"].get("optimizer", 0.0))
        if sp.get("note"):
            lines.append(f"note: {sp['note']}")
    return lines


def _without_optimizer(t: dict, optimizer_s: float) -> list[str]:
    """The timed step is one microbatch and one AdamW update; the recipe's update runs
    `recipe_microbatches` microbatches before its one AdamW update. Its rate, derived from the
    timed step less the split's optimizer time (not timed as such)."""
    m, mb = t.get("recipe_microbatches"), t["step_s"] - optimizer_s
    if not (optimizer_s > 0 and m and mb > 0):
        return []
    per = lambda s: t["model_flops"] / (s * t.get("devices", 1)) / 1e12  # noqa: E731 - TFLOP/s per chip
    return [f"derived, not timed: the step less the split's {optimizer_s * 1e3:,.1f} ms of optimizer runs its "
            f"forward and backward at {per(mb):.0f} TFLOP/s per chip; the recipe's update ({m} microbatches, then "
            f"one AdamW update) at {per(mb + optimizer_s / m):.0f}"]


def kernel_lines(rows: list[dict]) -> list[str]:
    """Issue 41's attention candidates on one layer (device_check_kernels.py)."""
    if not rows:
        return []
    r0 = rows[0]
    lines = ["", f"decode attention, one layer: {r0['rows']} rows, {r0['prompts']} prompts of "
                 f"{r0['prompt_lens'][0]:,}-{r0['prompt_lens'][1]:,} tokens + {r0['reply']} each, "
                 f"{r0['q_heads']} query / {r0['kv_heads']} KV heads of {r0['head_dim']}; the bound's bytes "
                 f"{r0['kv_bytes'] / 2 ** 20:,.1f} MiB (each prompt once)", "",
             "| kernel | ms a call | bound's bytes / s, of the copy ceiling | max abs diff from gather | |",
             "| --- | --- | --- | --- | --- |"]
    for k in rows:
        if "s" in k:
            lines.append(f"| {k['kernel']} | {k['s'] * 1e3:,.3f} | {_fmt(k.get('fraction_of_copy'), '{:.1%}')} | "
                         f"{_fmt(k['max_abs_err'], '{:.4f}')} | {'' if k['ok'] else 'FAILED (differs)'} |")
        else:
            lines.append(f"| {k['kernel']} | - | - | - | {k.get('not_run') or 'FAILED: ' + k.get('error', '')} |")
    return lines


def engine_split_lines(rows: list[dict]) -> list[str]:
    """The engine's programs' op time by kind (device_check_split.py): the prefill chunk's over
    the whole call, the decode segment's per decode step, each with its share."""
    lines = []
    for r in rows:
        if "programs" not in r:
            lines += ["", f"engine time split: FAILED: {r.get('error', '')}"]
            continue
        kinds = list(next(iter(r["programs"].values()))["categories"]) if r["programs"] else []
        lines += ["", f"engine time split, {r['model']} {r['rows']} rows, {r['prompt_tokens']:,} prompt tokens + "
                      f"{r['max_new']} new (one call under the profiler, command buffers {r['command_buffers']}: "
                      f"prefill {r['prefill_s']:.3f} s, decode {r['decode_s']:.3f} s in {r['decode_steps']} steps)", "",
                  "| program | ms per | " + " | ".join(kinds) + " | all ops |", "| --- |" + " --- |" * (len(kinds) + 2)]
        for name, sp in r["programs"].items():
            steps = r["decode_steps"] if name.startswith("segment") and r["decode_steps"] else 1
            total = sp["ops_s"] or 1.0
            cells = [f"{v / steps * 1e3:,.2f} ({v / total:.0%})" for v in sp["categories"].values()]
            lines.append(f"| {name} | {'decode step' if steps > 1 else 'call'} | " + " | ".join(cells)
                         + f" | {sp['ops_s'] / steps * 1e3:,.2f} |")
    return lines


OOM = ("out of memory", "resource_exhausted")


def _measured_decodes(rep: dict) -> dict:
    """{(model, sampler, rows): row} of the decode rows that measured the workload cleanly."""
    return {(d.get("model"), d.get("sampler"), d.get("rows")): d for d in rep["decode"]
            if "tokens_per_s" in d and d.get("ok", True)}


def _unclean(d: dict) -> str:
    """Why a timed decode row is not a timing of its workload (device_check_decode's checks)."""
    why = []
    if (d.get("timed_call_compiles") or [0])[-1]:
        why.append(f"its timed call compiled {d['timed_call_compiles'][-1]} program(s)")
    if "prefilled_tokens" in d and d["prefilled_tokens"] != d["prompt_tokens"]:
        why.append(f"its timed call prefilled {d['prefilled_tokens']:,} of {d['prompt_tokens']:,} prompt tokens")
    if d.get("generated_tokens") != d.get("rows", 0) * d.get("max_new", 0):
        why.append(f"{d.get('generated_tokens')} tokens generated of {d.get('rows', 0) * d.get('max_new', 0)}")
    return "; ".join(why) or "see the JSON"


def goals(rep: dict) -> list[tuple[str, str]]:
    """Issues 41's and 42's goals read off this report: "met", "NOT MET (...)" or "not measured"
    (the row missing or failed other than out of memory), so a device call's last lines say
    where the work stands."""
    ok = _measured_decodes(rep)
    # with the traceback's tail: XLA's autotuner reports its own out-of-memory failures under
    # "NOT_FOUND: All configs failed during profiling" (run 1, 0.6B static at 256 rows)
    failed = {d.get("check", ""): " ".join([d.get("error", ""), *d.get("traceback", [])])
              for d in rep["decode"] if "tokens_per_s" not in d}

    def verdict(value, floor, fmt="{:.2f}x", ceiling=False):
        if value is None:
            return "not measured"
        good = value <= floor if ceiling else value >= floor
        return ("met" if good else "NOT MET") + f" ({fmt.format(value)})"

    def ratio(a, b, key="end_to_end_tokens_per_s"):
        return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None

    out = []
    engine = {rows: ok.get(("qwen3-4b", "engine", rows)) for rows in (256, 64)}
    for rows, d in engine.items():
        out.append((f"41.1 engine decode, 4B, {rows} rows, >= 60% of the HBM bound",
                    verdict(d and d.get("fraction_of_bound"), 0.60, "{:.1%}")))
    for rows, d in engine.items():
        out.append((f"41.2 engine vs static end to end, {rows} rows, >= 1.5x",
                    verdict(ratio(d, ok.get(("qwen3-4b", "static", rows))), 1.5)))
        out.append((f"41.2 engine vs transformers end to end, {rows} rows, >= 3x",
                    verdict(ratio(d, ok.get(("qwen3-4b", "transformers", rows))), 3.0)))
    names = [f"decode {m} {s} 256" for m in ("qwen3-4b", "qwen3-0.6b") for s in ("engine", "static")]
    ran = [n for n in names if (n.split()[1], n.split()[2], 256) in ok]
    oom = [n for n in names if any(w in failed.get(n, "").lower() for w in OOM)]
    out.append(("41.3 no out of memory at 256 rows (4B, 0.6B; engine, static)",
                f"NOT MET ({', '.join(oom)})" if oom else "met" if len(ran) == len(names) else
                f"not measured ({len(ran)} of {len(names)} rows ran)"))
    exact = [p for p in rep["parity"] if p.get("exact_required")]
    out.append(("41.4 float32 tokens on the device equal the CPU's (sampler, engine)",
                "not measured" if len(exact) < 2 else "met" if all(p["ok"] for p in exact) else
                "NOT MET (" + ", ".join(f"{p['rows_equal']}/{p['rows']}" for p in exact) + " rows equal)"))
    trains = [t for t in rep["train_step"] if "step_s" in t and t.get("model") == "qwen3-4b" and t["seq_len"] == 4096
              and t["attention"] in ("cudnn", "splash")]
    best = max(((t["model_flops"] / (t["step_s"] * t.get("devices", 1)) / 1e12,
                 ", ".join(([f"remat {t['remat']}, layers unrolled"] if t.get("scan_unroll") == 0 else [])
                           + ([f"XLA_FLAGS={t['xla_flags']}"] if t.get("xla_flags") else [])))
                for t in trains), default=(None, ""))
    # a row under a candidate (XLA flags, unrolled layers) says so: it is not yet `actionopd train`'s
    out.append(("42.1 4B train step at 4,096 tokens, >= 500 TFLOP/s per chip",
                verdict(best[0], 500, "{:.0f} TFLOP/s" + (f", {best[1]}" if best[1] else ""))))
    # the plan is the scanned update's: an unrolled candidate's peak is not what it plans
    worst = max((t["plan_bytes"] / t["peak_bytes"] for t in rep["train_step"] if t.get("peak_bytes")
                 and t.get("plan_bytes") and t.get("scan_unroll") is None), default=None)
    out.append(("42.2 train --check's plan within 1.15x of the measured peak", verdict(worst, 1.15, ceiling=True)))
    return out

