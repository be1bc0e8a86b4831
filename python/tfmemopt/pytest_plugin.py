"""Run a test suite with tfmemopt on: a pytest plugin.

    python -m pytest -p tfmemopt.pytest_plugin [--tfmemopt-budget B]
        [--tfmemopt-field NAME=VALUE ...] [--tfmemopt-summary FILE] tests/

Loaded with `-p`, it calls tfmemopt.enable() before any test is collected, so every
graph the suite builds (tf.function, Keras fit, tf.distribute) is planned and rewritten
as in a user's script under enable(). A suite that passes without the plugin should
pass with it: that is how to check that tfmemopt changes nothing your code depends on,
and, with a budget no graph can meet (`--tfmemopt-budget 1`, one byte), that every
rewrite the planner can make keeps your results. It is not registered as an entry
point: pytest runs never load it unless asked.

--tfmemopt-budget: as enable()'s budget: bytes ("1", "512MiB") or a fraction of the
device memory ("0.5"); default: enable()'s (budget_fraction 0.9).
--tfmemopt-field: a field of tfmemopt.MemoryOptimizerConfig; the value is read as JSON
when it parses ("false", "0", '["scope/"]'), else as a string. Repeatable.
--tfmemopt-summary: appends JSON objects to FILE: one per xdist worker ("process":
"worker"), then the session's ("process": "total").

At the end pytest prints what the pass did over the session: graphs planned, graphs
changed, tensors swapped, ops recomputed, graphs split, and the graphs where a stage
failed and TF ran the original graph (a fall-back), with their messages. A fall-back
never fails a test (the original graph is correct), but it is a tfmemopt bug.
"""

import collections
import json

import pytest

_SUMMARY_KEY = "tfmemopt_summary"
_COUNTS = ("graphs", "changed", "swapped_tensors", "recomputed_ops", "split_graphs",
           "fallbacks")


def pytest_addoption(parser):
    group = parser.getgroup("tfmemopt", "tfmemopt: run the suite with the memory optimizer on")
    group.addoption("--tfmemopt-budget", default=None, metavar="B",
                    help="enable()'s budget: bytes ('1', '512MiB') or a fraction ('0.5')")
    group.addoption("--tfmemopt-field", action="append", default=[], metavar="NAME=VALUE",
                    help="a MemoryOptimizerConfig field (value read as JSON when it parses)")
    group.addoption("--tfmemopt-summary", default=None, metavar="FILE",
                    help="append what the pass did, as JSON lines, to FILE")


def parse_budget(text):
    """A budget as given on the command line: '1' (bytes), '0.5' (fraction), '6GiB'."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_fields(items):
    """['name=value', ...] -> {name: value}, each value read as JSON when it parses."""
    fields = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(
                f"tfmemopt: --tfmemopt-field {item!r}: expected NAME=VALUE, e.g. "
                "enable_swap=false")
        try:
            fields[name] = json.loads(value)
        except ValueError:
            fields[name] = value
    return fields


def pytest_configure(config):
    import tfmemopt

    try:
        budget = parse_budget(config.getoption("tfmemopt_budget"))
        fields = parse_fields(config.getoption("tfmemopt_field"))
        tfmemopt.enable(budget, **fields)
    except (TypeError, ValueError) as error:
        raise pytest.UsageError(str(error)) from None
    config._tfmemopt_worker_summaries = []
    config._tfmemopt_fallback_tests = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Notes the test whose call added a report that fell back."""
    from tfmemopt import _ext, feedback

    before = feedback.report_count()
    yield
    for text in _ext.reports(before):
        data = json.loads(text)
        if data["status"] != "ok":
            item.config._tfmemopt_fallback_tests[data["graph_id"]] = item.nodeid


def session_summary(fallback_tests=None):
    """What the pass did in this process: counts over tfmemopt.reports() and the
    messages of the graphs that fell back (with the test that built each, when known)."""
    import tfmemopt

    reports = tfmemopt.reports()
    fallbacks = [r for r in reports if r.status != "ok"]
    fallback_tests = fallback_tests or {}
    return {
        "graphs": len(reports),
        "changed": sum(bool(r.graph_changed) for r in reports),
        "swapped_tensors": sum(len(r.swapped_tensors) for r in reports),
        "recomputed_ops": sum(len(r.recomputed_ops) for r in reports),
        "split_graphs": sum(bool(r.split_ops) for r in reports),
        "fallbacks": len(fallbacks),
        "fallback_messages": sorted({
            f"{r.graph_id}"
            + (f" (in {fallback_tests[r.graph_id]})" if r.graph_id in fallback_tests else "")
            + f": {r.message}" for r in fallbacks}),
    }


def _combine(summaries):
    total = collections.Counter()
    messages = set()
    for summary in summaries:
        total.update({key: summary[key] for key in _COUNTS})
        messages.update(summary["fallback_messages"])
    return {**{key: total[key] for key in _COUNTS}, "fallback_messages": sorted(messages)}


def _append(path, record):
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_testnodedown(node, error):
    """xdist: the controller collects each worker's summary."""
    summary = getattr(node, "workeroutput", {}).get(_SUMMARY_KEY)
    if summary is not None:
        node.config._tfmemopt_worker_summaries.append(summary)


def _is_worker(config):
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session):
    config = session.config
    if _is_worker(config):
        config.workeroutput[_SUMMARY_KEY] = session_summary(config._tfmemopt_fallback_tests)


def pytest_terminal_summary(terminalreporter, config):
    if _is_worker(config):
        return
    workers = config._tfmemopt_worker_summaries
    summary = (_combine(workers) if workers
               else session_summary(config._tfmemopt_fallback_tests))
    path = config.getoption("tfmemopt_summary")
    if path:
        for worker in workers:
            _append(path, {"process": "worker", **worker})
        _append(path, {"process": "total", **summary})
    write = terminalreporter.write_line
    terminalreporter.section("tfmemopt")
    write(f"{summary['graphs']} graphs planned, {summary['changed']} changed "
          f"({summary['swapped_tensors']} tensors swapped, {summary['recomputed_ops']} ops "
          f"recomputed, {summary['split_graphs']} graphs split), "
          f"{summary['fallbacks']} fell back to the original graph")
    for message in summary["fallback_messages"][:20]:
        write(f"  fall-back: {message}")
