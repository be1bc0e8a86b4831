"""Renders the result tables of README.md and docs/*.md from docs/results/*.json.

    python tools/gen_docs.py           # rewrites every generated block
    python tools/gen_docs.py --check   # exit 1 if a block differs from its result file

A generated block is

    <!-- results:NAME[:VIEW] -->
    ...
    <!-- /results:NAME[:VIEW] -->

and holds what RENDERERS[NAME, VIEW] makes of docs/results/NAME.json (written by
benchmarks/results.py: the benchmark's JSON with its command, commit, date and machine).
Every figure in such a block comes from the file; tests/test_docs.py runs --check. A
block whose result file does not exist says so, and gives the command that makes it.

Standard library only.
"""

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- results:([\w]+)(?::([\w]+))? -->\n)(.*?)(<!-- /results:\2(?::\3)? -->)",
                   re.S)
MIB = 2.0 ** 20


def mib(value):
    return "—" if value is None else f"{value / MIB:.1f} MiB"


def pct(value, signed=True):
    if value is None:
        return "—"
    return f"{100 * value:+.1f} %" if signed else f"{100 * value:.1f} %"


def num(value):
    return "—" if value is None else str(value)


def source(record):
    """The line under every table: the command, the commit and the machine."""
    load = record.get("machine", {}).get("load_average")
    load = f", load average {load[0]:.1f} at the end" if load else ""
    imported = " (recorded from its log)" if record.get("imported_from_log") else ""
    if imported:
        load = ""  # the machine's load when the log was recorded, not when it ran
    onednn = record.get("machine", {}).get("onednn")
    kernels = "" if onednn is None else (
        f", on {record['machine'].get('cpu') or 'an unnamed CPU'} with oneDNN "
        f"{'on' if onednn else 'off'}")
    return (f"`{record['command']}` at commit `{record['commit']}`, {record['date']}"
            f"{kernels}{imported}{load}.")


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


# --- renderers: record -> markdown lines --------------------------------------------

def plan_time(record):
    r = record["result"]
    rows = [[f"{r['nodes']:,}", f"{r['plan_seconds']:.2f} s", f"{r['analysis_only_seconds']:.2f} s",
             r["simulations"], mib(r["peak_before_bytes"]), mib(r["budget_bytes"]),
             mib(r["peak_after_bytes"]),
             "yes" if r["fits"] else "no", r["recomputed_ops"], r["swapped_tensors"]]]
    return table(["nodes", "pass time", "analysis alone", "plans simulated", "peak before",
                  "budget", "peak after", "fits", "recomputed ops", "swapped tensors"], rows)


def v1_graphs(record):
    r = record["result"]
    rows = []
    for name, g in r["graphs"].items():
        rows.append([name, mib(g["predicted"]), mib(g["measured"]), pct(g["error"]),
                     mib(g["budget"]), mib(g["planned_predicted"]), mib(g["planned_measured"]),
                     f"{g['recomputed']} / {g['swapped']}",
                     "yes" if g["losses_equal"] else "NO"])
    return table(["graph", "predicted", "measured", "error", "budget (0.5x)", "planned: predicted",
                  "planned: measured", "recomputed / swapped", "losses bitwise equal"], rows)


def _accuracy_row(name, m):
    u, p = m.get("unplanned", {}), m.get("planned", {})
    fits = {True: "yes", False: "no"}.get(p.get("fits"), "—") if p else "—"
    return [name, mib(u.get("predicted")), mib(u.get("measured")), pct(u.get("error")),
            mib(p.get("budget")) if p else "—", fits, mib(p.get("predicted")),
            mib(p.get("measured")), pct(p.get("error"))]


def peak_accuracy(record):
    """Per model: unplanned and planned (budget 0.6x) predicted against measured peak;
    models reported apart (unpredictable with TF's default threads) with both settings."""
    r = record["result"]
    rows = [_accuracy_row(name, m) for name, m in r["models"].items()]
    for name, settings in r.get("apart", {}).items():
        for setting, m in settings.items():
            rows.append(_accuracy_row(f"{name} ({setting.replace('_', ' ')})", m))
    header = ["model", "predicted", "measured", "error", "planned: budget", "says it fits",
              "predicted", "measured", "error"]
    per_process = r.get("set_per_process", {})
    lines = table(header, rows)
    for name, g in per_process.items():
        groups = "; ".join(
            f"{', '.join(f'{b / 2**20:.1f}' for b in group)} MiB ({pct(e)})"
            for group, e in zip(g["groups"], g["errors"]))
        lines += ["", f"{name}'s plain step peaked in groups set per process, no one figure "
                      f"within {r.get('margin', 0.08) * 100:.0f} % of all: predicted "
                      f"{mib(g['predicted'])}; processes {groups} (error against each "
                      f"group's median). Its unplanned row is not counted below."]
    return lines + [
        "", f"Largest error with TF's default threads: unplanned "
            f"{pct(r.get('max_abs_error_unplanned'), False)}, planned "
            f"{pct(r.get('max_abs_error_planned'), False)}."]


def unseen_models(record):
    """Per model: bitwise equal, unplanned and planned predictions against measured."""
    r = record["result"]
    rows = []
    for name, m in r["rows"].items():
        if "bitwise_equal" not in m:
            rows.append([name, "error: " + m.get("error", "")[:80]] + ["—"] * 7)
            continue
        u, p = m["unplanned"], m["planned"]
        equal = {True: "yes", False: "NO", None: "plain TF varies"}[m["bitwise_equal"]]
        checks = [{True: "yes, one inter-op thread", False: "NO, one inter-op thread"}.get(
                      m.get("one_inter_op_thread_equal")),
                  {True: "yes, sums in a fixed order", False: "NO, sums in a fixed order"}.get(
                      m.get("fixed_order_sums_equal"))]
        checks = "; ".join(c for c in checks if c)
        equal += f" ({checks})" if checks else ""
        rows.append([name, equal,
                     mib(u["predicted"]), mib(u["measured"]), pct(u["error"]),
                     mib(m["budget_bytes"]), "yes" if p["fits"] else "no",
                     mib(p["predicted"]), mib(p["measured"]), pct(p["error"])])
    header = ["model", "bitwise equal", "predicted", "measured", "error",
              f"planned: budget ({r.get('ratio', 0.6)}x)", "says it fits", "predicted",
              "measured", "error"]
    one_thread = ""
    if r["mismatches"] and "mismatches_one_inter_op_thread" in r:
        one_thread = (" (with one inter-op thread too: "
                      f"{', '.join(r['mismatches_one_inter_op_thread']) or 'none'})")
    fixed_order = ""
    if "mismatches_fixed_order_sums" in r:
        sums = r.get("arrival_order_sums", {})
        fixed_order = (f"; TF adds sums in arrival order in "
                       f"{', '.join(f'{n} ({len(v)})' for n, v in sums.items()) or 'none'}"
                       f"; mismatches with those sums in a fixed order: "
                       f"{', '.join(r['mismatches_fixed_order_sums']) or 'none'}")
    return table(header, rows) + [
        "", f"{r['bitwise_equal']} of {r['models']} models bitwise equal"
            f"{'; plain TF does not repeat itself on ' + ', '.join(r['plain_not_repeatable']) if r.get('plain_not_repeatable') else ''}"
            f"; mismatches: {', '.join(r['mismatches']) or 'none'}"
            f"{one_thread}{fixed_order}"
            f"; fall-backs: "
            f"{', '.join(r['fallbacks']) or 'none'}; largest error unplanned "
            f"{pct(r.get('max_abs_error_unplanned'), False)}, planned where the report says "
            f"it fits {pct(r.get('max_abs_error_planned_fits'), False)}."]


def keras_test_suite(record):
    """Keras's own tests, plain and with the pass on: outcomes and what the pass did."""
    r = record["result"]
    fields = ", ".join(r["fields"]) or "none"
    rows = [
        ["tests", r["tests"]],
        ["pass without tfmemopt", r["passed_plain"]],
        ["pass with tfmemopt", r["passed_tfmemopt"]],
        ["fail both ways (a module needs a package not installed, or a download)",
         r["failed_both"]],
        ["broken by tfmemopt", len(r["broken_by_tfmemopt"])],
        ["flaky (failed once with tfmemopt, passed alone both ways)", len(r["flaky"])],
        ["graphs planned", r["graphs"]],
        ["graphs changed", r["changed"]],
        ["tensors swapped, ops recomputed, graphs split",
         f"{r['swapped_tensors']}, {r['recomputed_ops']}, {r['split_graphs']}"],
        ["fall-backs to the original graph", r["fallbacks"]],
    ]
    lines = table([f"Keras {r['keras']}, budget {r['budget']} B, fields {fields}", ""], rows)
    named = [f"broken: {t}" for t in r["broken_by_tfmemopt"]] + [
        f"flaky: {t}" for t in r["flaky"]] + [
        f"fall-back: {m}" for m in r["fallback_messages"]]
    return lines + ([""] + [f"- {n}" for n in named] if named else [])


def max_batch(key_base, key_swap, key_auto, what):
    def render(record):
        r = record["result"]
        base = r.get(key_base)
        rows = []
        for label, key, overhead in (("without tfmemopt", key_base, None),
                                     ("tfmemopt, swap only" if key_swap == "max_batch_tfmemopt"
                                      else "tfmemopt, recompute only", key_swap,
                                      r.get("overhead_at_baseline_max")),
                                     ("tfmemopt (auto)", key_auto, r.get("overhead_auto")),
                                     ("tfmemopt (auto, split_batch_statistics=False)",
                                      key_auto + "_exact", r.get("overhead_auto_exact"))):
            value = r.get(key)
            if value is None:
                continue
            ratio = f"{value / base:.2f}x" if base and key != key_base else "1.00x"
            rows.append([label, value, ratio, pct(overhead) if overhead is not None else "—"])
        return table(["configuration", f"largest {what}", "vs without", "step time vs without"],
                     rows)
    return render


def _at_least(value, hi):
    """A search that trained its largest size says only that the limit is above it."""
    return f"≥ {value} (the search's end)" if hi and value == hi else num(value)


def _ratio(value, base, hi):
    """value / base, a lower bound ("≥") when value is the search's end."""
    if not (base and value):
        return "—"
    return ("≥ " if hi and value == hi else "") + f"{value / base:.2f}x"


def seed000(record):
    r = record["result"]
    sizes = r["max_batch"]
    hi = r.get("settings", {}).get("hi")
    base = sizes.get("NO_MEM_OPT")
    rows = [[name, _at_least(value, hi), _ratio(value, base, hi)]
            for name, value in sizes.items()]
    lines = table(["configuration", "largest batch", "vs NO_MEM_OPT"], rows)
    lines += ["", f"`floor_batch` (ops kept whole): {num(r.get('floor_batch'))}; "
                  f"`floor_batch_split` (ops split along the batch): "
                  f"{num(r.get('floor_batch_split'))}; step time at NO_MEM_OPT's "
                  f"largest batch: {pct(r.get('overhead_at_baseline_max'))}."]
    return lines


def unet_split(record):
    r = record["result"]
    hi = r.get("settings", {}).get("hi")
    base = r.get("max_batch_baseline")
    rows = []
    for key, label, overhead in (("max_batch_baseline", "plain TF", None),
                                 ("max_batch_no_split", "tfmemopt, enable_split=false",
                                  r.get("overhead_no_split")),
                                 ("max_batch_split", "tfmemopt (splitting allowed)",
                                  r.get("overhead_split"))):
        value = r.get(key)
        rows.append([label, _at_least(value, hi), _ratio(value, base, hi),
                     pct(overhead) if overhead is not None else "—"])
    return table(["configuration", "largest batch", "vs plain TF",
                  f"step time at batch {num(r.get('timed_size'))}"], rows)


def stress(record):
    r = record["result"]
    keys = ["cases", "rewritten", "split", "split_through_batch_statistics", "mismatches",
            "invalid_graphs", "crashes", "violations", "fallbacks", "errors", "seconds"]
    return table(keys, [[num(r.get(k, 0 if k == "errors" else None)) for k in keys]])


def optimality(record):
    r = record["result"]
    keys = ["cases", "proven_optimal", "ratios_counted", "max_ratio", "mean_ratio",
            "missed_budget", "check_failures"]
    return table(keys, [[num(r.get(k)) for k in keys]])


_PEER_NAMES = {"plain_tf": "plain TF", "recompute_grad": "tf.recompute_grad",
               "tfmemopt": "tfmemopt"}


def _peer_name(name):
    if name in _PEER_NAMES:
        return _PEER_NAMES[name]
    if name.startswith("grappler_"):
        return "Grappler " + name[len("grappler_"):]
    if name.startswith("keras_remat_"):
        return "RematScope " + name[len("keras_remat_"):]
    return name


def _peer_batch(c, run):
    """A configuration's largest batch; "≥ N" when the top of the search trained."""
    value = c.get("max_batch")
    if value is None:
        return "raises" if c.get("status") == "error" else "—"
    top = c.get("min_failing_batch") is None and value == run.get("hi")
    return f"≥ {value}" if top else str(value)


def peers(record):
    r = record["result"]
    lines = []
    for model, per_config in r.get("models", {}).items():
        run = r.get("runs", {}).get(model, {})
        lines += [f"**{model}**: cap {num(run.get('cap_mb'))} MiB, batches "
                  f"{num(run.get('lo'))}..{num(run.get('hi'))} in steps of "
                  f"{num(run.get('batch_step'))}; step time at batch "
                  f"{num(run.get('timed_batch'))}, losses at batch {num(run.get('loss_batch'))}.", ""]
        rows = []
        for name, c in per_config.items():
            ratio = c.get("step_ratio")
            rows.append([_peer_name(name), _peer_batch(c, run),
                         f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else "—",
                         {True: "yes", False: "NO"}.get(c.get("loss_equal"), "—"),
                         (c.get("note") or c.get("error") or c.get("reason") or "")
                         .replace("|", "/").splitlines()[0][:160] if (c.get("note") or c.get("error") or c.get("reason")) else ""])
        lines += table(["configuration", "largest batch", "step time vs plain TF",
                        "losses bitwise equal", "note"], rows) + [""]
    return lines[:-1]


def peers_summary(record):
    """README: per model, plain TF, tfmemopt, tf.recompute_grad and the best RematScope."""
    r = record["result"]
    rows = []
    for model, per_config in r.get("models", {}).items():
        run = r.get("runs", {}).get(model, {})
        plain = per_config.get("plain_tf", {})
        mine = per_config.get("tfmemopt", {})
        remat = [(c.get("max_batch") or 0, name) for name, c in per_config.items()
                 if name.startswith("keras_remat") and c.get("max_batch")]
        best = max(remat) if remat else None
        best_text = (f"{best[0]} ({_peer_name(best[1])[len('RematScope '):]})" if best
                     else "every mode raises")
        ratio = mine.get("step_ratio")
        rows.append([f"{model} ({num(run.get('cap_mb'))} MiB)", _peer_batch(plain, run),
                     _peer_batch(mine, run),
                     _peer_batch(per_config.get("recompute_grad", {}), run), best_text,
                     pct(ratio - 1) if isinstance(ratio, (int, float)) else "—"])
    return table(["model (cap)", "plain TF", "tfmemopt", "tf.recompute_grad",
                  "Keras RematScope (best mode)", "tfmemopt step time vs plain TF"], rows)


def recurrent(record):
    """benchmarks/recurrent.py: the largest batch of a recurrent model under a cap."""
    r = record["result"]
    s = r.get("settings", {})
    base, mine = r.get("max_batch_baseline"), r.get("max_batch_tfmemopt")
    hi = s.get("hi")
    rows = [["without tfmemopt", _at_least(base, hi), "1.00x", "—"],
            ["tfmemopt", _at_least(mine, hi),
             _ratio(mine, base, hi),
             pct(r.get("overhead_at_baseline_max"))]]
    equal = {True: "bitwise equal", False: "DIFFERENT"}.get(r.get("equal"), "not compared")
    return table(["configuration", "largest batch", "vs without",
                  f"step time at batch {num(r.get('timed_at'))}"], rows) + [
        "", f"{s.get('model')}: {s.get('steps')} steps, {s.get('units')} units, "
            f"{s.get('features')} features, cap {num(s.get('cap_mb'))} MiB; a batch trains "
            f"when {num(s.get('repeats'))} fresh processes train it. Losses and weights "
            f"after {num(s.get('check_steps'))} steps at batch {num(s.get('check_batch'))}: "
            f"{equal}."]


def fits_means_trains(record):
    """Per model: the unplanned limit, the sizes the report said fit, how many of them
    ran out of memory; then the failures."""
    r = record["result"]
    rows = []
    for model, m in r.get("per_model", {}).items():
        claims = m.get("claims", [])
        failed = [f["batch"] for f in r.get("failures", []) if f["model"] == model]
        row = [model, num(m.get("cap_mb")), num(m.get("unplanned_limit")),
               ", ".join(str(c.get("batch", c) if isinstance(c, dict) else c)
                         for c in claims) or "none",
               ", ".join(map(str, failed)) or "—"]
        if r.get("retry"):
            retried = [c["batch"] for c in claims
                       if isinstance(c, dict) and c.get("retried") and c.get("status") == "ok"]
            row.append(", ".join(map(str, retried)) or "—")
        rows.append(row)
    header = ["model", "cap (MiB)", "largest batch without tfmemopt",
              "batches the report said fit", "of which ran out of memory"]
    if r.get("retry"):
        header.append("trained after a re-plan")
    lines = table(header, rows)
    lines += ["", f"{num(r.get('claims'))} claims on {num(r.get('models_swept'))} models, "
                  f"{num(r.get('fits_but_oom'))} ran out of memory; retries "
                  f"{'on' if r.get('retry') else 'off'} (trained after a re-plan: "
                  f"{num(r.get('trained_after_retry'))}); largest |error| of a claim that "
                  f"trained: {pct(r.get('max_abs_error'), False)}."]
    if r.get("retry") and "first_attempt_oom" in r:
        clean = r.get("models_without_oom", [])
        lines += ["", f"First attempts that ran out of memory (what the same run without "
                      f"`--retry` counts): {num(r['first_attempt_oom'])}; models with claims and "
                      f"none: {len(clean)} ({', '.join(clean) or 'none'})."]
    if r.get("retry") and "calibrated" in r:
        lines += ["", f"Claims whose step measured over its budget, so that the steps after "
                      f"it were planned lower (calibrations kept): {num(r['calibrated'])}."]
    return lines


def loop_pacing(record):
    """benchmarks/loop_pacing.py: a planned recurrent step with and without the pace
    stage: step time and BFC peak."""
    r = record["result"]
    rows = []
    for model, m in r.get("models", {}).items():
        predicted = m.get("predicted_bytes")
        cells = [model, mib(m.get("budget_bytes")), mib(predicted)]
        for label in ("paced", "unpaced"):
            t = m.get(label, {})
            seconds, peak = t.get("median_seconds"), t.get("peak_bytes")
            cells += [f"{seconds:.3f} s" if seconds else t.get("status", "—"),
                      f"{mib(peak)} ({pct(peak / predicted - 1)})" if peak and predicted
                      else "—"]
        cells.append(pct(m.get("overhead")))
        rows.append(cells)
    return table(["model", "budget", "predicted", "paced: step", "paced: peak (vs predicted)",
                  "not paced: step", "not paced: peak (vs predicted)",
                  "step time of pacing"], rows)


def bilstm_fit(record):
    """benchmarks/bilstm_fit.py: per batch and mode, what the plan said and how many
    processes trained."""
    r = record["result"]
    rows = {}
    for t in r.get("results", []):
        row = rows.setdefault((t["batch"], t["mode"]), {"said": set(), "trained": 0, "n": 0,
                                                        "bitwise": set(), "peak": 0,
                                                        "retried": 0})
        row["n"] += 1
        row["trained"] += t["outcome"] == "trained"
        row["retried"] += t["outcome"] == "trained" and bool(t.get("retries"))
        row["peak"] = max(row["peak"], t.get("peak_bytes") or 0)
        if "fits" in t:
            row["said"].add(f"{'fits' if t['fits'] else 'does not fit'} "
                            f"({mib(t.get('predicted_bytes'))})")
        if "bitwise_equal_uncapped" in t:
            row["bitwise"].add("yes" if t["bitwise_equal_uncapped"] else "NO")
    out = []
    for (batch, mode), row in sorted(rows.items()):
        trained = f"{row['trained']} of {row['n']}"
        if row["retried"]:
            trained += f" ({row['retried']} after a retry)"
        out.append([str(batch), mode, ", ".join(sorted(row["said"])) or "—",
                    trained, mib(row["peak"]),
                    ", ".join(sorted(row["bitwise"])) or "—"])
    return table(["batch", "mode", "the last plan said", "trained", "highest peak",
                  "losses equal uncapped"], out)


RENDERERS = {
    ("bilstm_fit", None): bilstm_fit,
    ("loop_pacing", None): loop_pacing,
    ("plan_time", None): plan_time,
    ("v1_graphs", None): v1_graphs,
    ("peak_accuracy", None): peak_accuracy,
    ("unseen_models", None): unseen_models,
    ("keras_test_suite", None): keras_test_suite,
    ("resnet50_lms", None): max_batch("max_batch_baseline", "max_batch_tfmemopt",
                                      "max_batch_auto", "batch"),
    ("resnet50_lms_reserved", None): max_batch("max_batch_baseline", "max_batch_tfmemopt",
                                               "max_batch_auto", "batch"),
    ("deep_resnet", None): max_batch("max_depth_baseline", "max_depth_tfmemopt",
                                     "max_depth_auto", "depth"),
    ("seed000", None): seed000,
    ("unet_split", None): unet_split,
    ("recurrent_stacked_gru", None): recurrent,
    ("recurrent_stacked_lstm", None): recurrent,
    ("stress", None): stress,
    ("fits_means_trains", None): fits_means_trains,
    ("fits_means_trains_unseen", None): fits_means_trains,
    ("fits_means_trains_unseen_more", None): fits_means_trains,
    ("optimality", None): optimality,
    ("peers", None): peers,
    ("peers", "summary"): peers_summary,
}


def render_block(name, view):
    renderer = RENDERERS.get((name, view))
    if renderer is None:
        raise KeyError(f"no renderer for results:{name}{':' + view if view else ''}")
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return (f"No result file yet: run `python benchmarks/results.py run {name}` "
                f"(docs/results/{name}.json).\n")
    record = json.loads(path.read_text())
    return "\n".join(renderer(record) + ["", source(record)]) + "\n"


def render(text):
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group(2), m.group(3)) + m.group(5),
                     text)


def _shown(path):
    path = path.resolve()
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if a generated block is out of date")
    parser.add_argument("files", nargs="*", type=pathlib.Path)
    args = parser.parse_args(argv)
    stale = []
    for path in args.files or DOCS:
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("generated result tables differ from docs/results in: "
              + ", ".join(_shown(p) for p in stale)
              + "; run python tools/gen_docs.py", file=sys.stderr)
        return 1
    for path in stale if not args.check else []:
        print(f"{_shown(path)}: result tables regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
