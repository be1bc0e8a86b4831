"""The tfmemopt command line: `tfmemopt demo`, `analyze`, `maxbatch` and `bench`.

Exit codes: 0 success, 1 the job ran but failed, 2 bad usage or input.
"""

import argparse
import difflib
import json
import os
import re
import sys

_EXPECTED = "expected a SavedModel directory or a GraphDef/MetaGraphDef .pb file"
# Signature that SavedModels carry for their initializer: not part of a step.
_INIT_SIGNATURE = "__saved_model_init_op"


class _InputError(Exception):
    """Bad input for `analyze`: printed as one line, exit code 2."""


def _format_mib(n):
    return f"{n / 2**20:.1f} MiB"


def _demo(args):
    from tfmemopt.demo import run_demo

    print(f"tfmemopt demo: a CIFAR-shaped ResNet with {args.blocks} residual blocks, batch "
          f"{args.batch}, Adam, {args.steps} steps, on a CPU allocator capped at "
          f"{args.cap_mb} MiB (TF_CPU_ALLOCATOR_USE_BFC); one interpreter per run\n",
          flush=True)
    runs = run_demo(blocks=args.blocks, batch=args.batch, cap_mb=args.cap_mb, steps=args.steps)
    labels = {"without": f"without tfmemopt, capped at {args.cap_mb} MiB",
              "with": f"with tfmemopt, capped at {args.cap_mb} MiB",
              "reference": "without tfmemopt, no cap"}
    for name, trial in runs.items():
        if trial.ok:
            peak = f"measured peak {_format_mib(trial.peak_bytes)}" if trial.peak_bytes else ""
            status = f"trained; {peak}".rstrip("; ")
        elif trial.status == "oom":
            status = "ran out of memory"
        else:
            status = f"FAILED: {trial.error.splitlines()[0] if trial.error else trial.status}"
        print(f"{labels[name]:>36}: {status}")
    mine = runs["with"]
    if mine.report:
        from tfmemopt.report import Report

        print("\n" + Report(mine.report).to_text())
    reference = runs["reference"]
    same = None
    if mine.ok and reference.ok:
        same = mine.outputs == reference.outputs
        print(f"\nlosses with tfmemopt under the cap and without it, uncapped, are "
              f"{'bitwise equal' if same else 'DIFFERENT'}: {[o[0] for o in mine.outputs]}")
    if args.json:
        print(json.dumps({name: trial.brief() | {"outputs": trial.outputs}
                          for name, trial in runs.items()}))
    shown = runs["without"].status == "oom" and mine.ok and same
    return 0 if shown else 1


def _is_graph(graph_def):
    return len(graph_def.node) > 0 and all(node.name and node.op for node in graph_def.node)


def _parse(message_class, data):
    from google.protobuf.message import DecodeError

    try:
        return message_class.FromString(data)
    except DecodeError:
        return None


def _load_saved_model(path, saved_model_file):
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    with open(saved_model_file, "rb") as f:
        data = f.read()
    if saved_model_file.endswith(".pbtxt"):
        try:
            saved_model = text_format.Parse(data.decode("utf-8"), saved_model_pb2.SavedModel())
        except (text_format.ParseError, UnicodeDecodeError):
            saved_model = None
    else:
        saved_model = _parse(saved_model_pb2.SavedModel, data)
    graphs = [m for m in saved_model.meta_graphs if _is_graph(m.graph_def)] if saved_model else []
    if not graphs:
        raise _InputError(f"{path} is not a GraphDef, MetaGraphDef or SavedModel "
                          f"({os.path.basename(saved_model_file)} holds no graph)")
    train = [m for m in graphs if "train" in m.meta_info_def.tags]
    chosen = (train or graphs)[0]
    tags = ",".join(chosen.meta_info_def.tags) or "no tags"
    return chosen, f"SavedModel, meta graph tagged {tags}"


def _load_metagraph(path):
    """(MetaGraphDef, what it was) of a SavedModel directory or a binary SavedModel,
    MetaGraphDef or GraphDef file. Raises _InputError naming what was expected."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    if not os.path.exists(path):
        raise _InputError(f"{path}: no such file or directory; {_EXPECTED}")
    if os.path.isdir(path):
        for name in ("saved_model.pb", "saved_model.pbtxt"):
            if os.path.isfile(os.path.join(path, name)):
                return _load_saved_model(path, os.path.join(path, name))
        raise _InputError(f"{path} is a directory without saved_model.pb, so not a "
                          f"SavedModel; {_EXPECTED}")
    with open(path, "rb") as f:
        data = f.read()
    # The parser rejects bytes of another message type (wrong wire types), so the
    # first type that parses and holds graph nodes is what the file is.
    saved_model = _parse(saved_model_pb2.SavedModel, data)
    if saved_model is not None and any(_is_graph(m.graph_def) for m in saved_model.meta_graphs):
        return _load_saved_model(path, path)
    metagraph = _parse(meta_graph_pb2.MetaGraphDef, data)
    if metagraph is not None and _is_graph(metagraph.graph_def):
        return metagraph, "MetaGraphDef"
    graph_def = _parse(graph_pb2.GraphDef, data)
    if graph_def is not None and _is_graph(graph_def):
        metagraph = meta_graph_pb2.MetaGraphDef()
        metagraph.graph_def.CopyFrom(graph_def)
        return metagraph, "GraphDef"
    what = "an empty file" if not data else "a binary protobuf with graph nodes expected"
    raise _InputError(f"{path} is not a GraphDef, MetaGraphDef or SavedModel ({what})")


def _tensor_names(tensor_info):
    encoding = tensor_info.WhichOneof("encoding")
    if encoding == "name":
        return [tensor_info.name]
    if encoding == "coo_sparse":
        sparse = tensor_info.coo_sparse
        return [sparse.values_tensor_name, sparse.indices_tensor_name,
                sparse.dense_shape_tensor_name]
    if encoding == "composite_tensor":
        return [name for component in tensor_info.composite_tensor.components
                for name in _tensor_names(component)]
    return []


def _fetches_of(metagraph, fetch=None):
    """(names to fetch, where they came from): --fetch, else the train op
    collection, else the outputs of the signatures."""
    if fetch:
        return list(dict.fromkeys(fetch)), "--fetch"
    # "saved_model_train_op" is where SavedModelBuilder(train_op=...) stores it.
    for key in ("train_op", "saved_model_train_op"):
        if key in metagraph.collection_def:
            # Optimizer.minimize() adds its op too, so a train op is often listed twice.
            names = list(dict.fromkeys(metagraph.collection_def[key].node_list.value))
            if names:
                return names, f"collection {key}"
    names, keys = [], []
    for key in sorted(metagraph.signature_def):
        if key == _INIT_SIGNATURE:
            continue
        outputs = metagraph.signature_def[key].outputs
        found = [n for out in sorted(outputs) for n in _tensor_names(outputs[out]) if n]
        if found:
            names.extend(n for n in found if n not in names)
            keys.append(key)
    label = "signature" if len(keys) == 1 else "signatures"
    return names, f"{label} {', '.join(keys)}" if names else None


def _node_name(name):
    return name.lstrip("^").split(":")[0]


def _check_fetches(metagraph, fetch, path, source):
    nodes = {node.name for node in metagraph.graph_def.node}
    for name in fetch:
        if _node_name(name) not in nodes:
            close = difflib.get_close_matches(_node_name(name), sorted(nodes), n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise _InputError(f"{path}: fetch {name!r} from {source} names no node of the "
                              f"graph{hint}")


def _prepare_metagraph(metagraph, fetch, default_device):
    """The MetaGraphDef the pass analyzes: the nodes that `fetch` needs, placed, with
    `fetch` as the train op."""
    from tensorflow.core.protobuf import meta_graph_pb2

    graph_def = metagraph.graph_def
    nodes = {node.name: node for node in graph_def.node}
    # Only what the step runs: a SavedModel also holds save/restore and init ops,
    # and their placeholders (e.g. saver_filename) would show up in the report as
    # tensors of unknown size.
    keep, stack = set(), [_node_name(name) for name in fetch]
    while stack:
        name = stack.pop()
        if name in keep or name not in nodes:
            continue
        keep.add(name)
        stack.extend(_node_name(i) for i in nodes[name].input)
    out = meta_graph_pb2.MetaGraphDef()
    out.graph_def.versions.CopyFrom(graph_def.versions)
    out.graph_def.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in keep:
            copy = out.graph_def.node.add()
            copy.CopyFrom(node)
            # As tfmemopt.analyze() does: training places an unpinned step on the
            # default device, and the report is per device.
            if not copy.device:
                copy.device = default_device
    # No saver_def, collections or signatures are carried over. A saver_def makes
    # Grappler preserve the save and restore calls, yet on TF 2.21 SavedModels its
    # function optimizer removes the save call anyway: the pass's verifier then sees
    # a preserved node vanish and falls back. (The same optimizer inlines the
    # signature's StatefulPartitionedCall, which is how the pass sees the step.)
    out.collection_def["train_op"].node_list.value.extend(fetch)
    return out


def _budget_arg(text):
    """--budget: '0.8' (a plain decimal) is a fraction of device memory, anything
    else a size in bytes ('2GiB', '512MB', '1073741824')."""
    if re.fullmatch(r"\s*(\d+\.\d*|\.\d+)\s*", text):
        return float(text)
    return text


def _check_output(option, path):
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise _InputError(f"{option} {path}: directory {directory} does not exist")


def _analyze(args):
    import tfmemopt
    from tfmemopt.analysis import _default_device

    fields = {"assume_batch_size": args.assume_batch_size} if args.assume_batch_size else {}
    budget = _budget_arg(args.budget) if args.budget is not None else None
    try:
        tfmemopt.make_config(budget, **fields)
    except (ValueError, TypeError) as err:
        message = str(err).removeprefix("tfmemopt: ")
        raise _InputError(f"--budget {args.budget}: {message}") from None
    for option, path in (("--plot", args.plot), ("--html", args.html)):
        if path:
            _check_output(option, path)
    if args.plot or args.html:
        try:
            from tfmemopt.report import _matplotlib
            _matplotlib()
        except ImportError as err:
            raise _InputError(f"{'--plot' if args.plot else '--html'} needs matplotlib: "
                              f"{str(err).split(': ')[-1]}") from None
    metagraph, kind = _load_metagraph(args.path)
    fetch, source = _fetches_of(metagraph, args.fetch)
    if not fetch:
        raise _InputError(f"{args.path} has no train op or fetch; pass --fetch NODE")
    _check_fetches(metagraph, fetch, args.path, source)
    prepared = _prepare_metagraph(metagraph, fetch, _default_device())
    print(f"tfmemopt analyze: {args.path} ({kind}); fetching {', '.join(fetch)} "
          f"(from {source})", flush=True)
    report = tfmemopt.analyze_metagraph(prepared, budget, **fields)
    print(report.to_text())
    title = os.path.basename(os.path.normpath(args.path))
    if args.plot:
        print(f"wrote plot {report.plot(args.plot, title=title)}")
    if args.html:
        print(f"wrote html {report.to_html(args.html, title=title)}")
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0 if report.status == "ok" else 1


def _size_or_none(n):
    return f"{n:,}" if n is not None else "-"


def _maxbatch_row(name, result):
    best = result.trial(result.max_batch) if result.max_batch is not None else None
    peak = _format_mib(best.peak_bytes) if best and best.peak_bytes else "n/a"
    step = f"{best.step_seconds:.3f}" if best and best.step_seconds is not None else "n/a"
    return (f"{name:<17} | {_size_or_none(result.max_batch):>9} | "
            f"{_size_or_none(result.min_failing_batch):>12} | {peak:>12} | {step:>8} | "
            f"{len(result.trials):>6} | {result.seconds:>7.1f}")


def _maxbatch(args):
    import tfmemopt
    from tfmemopt.maxbatch import TrialError, find_max_batch, step_reference

    try:
        step_reference(args.script)
    except ValueError as err:
        raise _InputError(str(err).removeprefix("tfmemopt: ")) from None
    if args.hi < args.lo:
        raise _InputError(f"--hi {args.hi} is below --lo {args.lo}; expected 1 <= lo <= hi")
    fields = {}
    if args.budget is not None:
        fields["budget"] = _budget_arg(args.budget)
        try:
            tfmemopt.make_config(**fields)
        except (ValueError, TypeError) as err:
            raise _InputError(f"--budget {args.budget}: "
                              f"{str(err).removeprefix('tfmemopt: ')}") from None
    print(f"tfmemopt maxbatch: {args.script}, sizes {args.lo}..{args.hi}, CPU allocator "
          f"capped at {args.cap_mb} MiB, {args.steps} steps per trial, one subprocess "
          f"per trial", flush=True)
    runs = [("with tfmemopt", True)]
    if not args.no_baseline:
        runs.insert(0, ("without tfmemopt", False))
    results, failed = {}, None
    for name, use in runs:
        try:
            results[name] = find_max_batch(
                args.script, args.lo, args.hi, cap_mb=args.cap_mb, steps=args.steps,
                timeout=args.timeout, strategy=args.strategy, use_tfmemopt=use,
                **(fields if use else {}))
        except TrialError as err:
            failed = (name, err)
            results[name] = err.result
            break
    print(f"\n{'':<17} | {'max batch':>9} | {'smallest OOM':>12} | {'peak at max':>12} | "
          f"{'s/step':>8} | {'trials':>6} | {'seconds':>7}")
    for name, result in results.items():
        print(_maxbatch_row(name, result))
    ratio = None
    base, opt = results.get("without tfmemopt"), results.get("with tfmemopt")
    if failed:
        name, err = failed
        print(f"\n{name}: {err}")
    else:
        for name, result in results.items():
            if result.max_batch is None:
                print(f"{name}: batch {args.lo} (--lo) does not fit: nothing in range trains")
            elif result.min_failing_batch is None:
                print(f"{name}: batch {args.hi} (--hi) trains: the limit is higher; "
                      f"raise --hi")
        if base and opt and base.max_batch and opt.max_batch is not None:
            ratio = opt.max_batch / base.max_batch
            print(f"\nlargest batch with tfmemopt / without: {ratio:.2f}x")
    if args.json:
        print(json.dumps({
            "script": args.script, "cap_mb": args.cap_mb, "lo": args.lo, "hi": args.hi,
            "baseline": base.to_dict() if base else None,
            "tfmemopt": opt.to_dict() if opt else None,
            "ratio": ratio,
            "error": str(failed[1]) if failed else None,
        }))
    return 1 if failed else 0


# Modules of benchmarks/ that other benchmarks import: not benchmarks themselves.
_BENCH_HELPERS = ("models", "export_train_step", "trace_step_memory")


def _benchmarks(directory):
    """{name: first line of its docstring} of the benchmarks in `directory`."""
    import ast

    found = {}
    for entry in sorted(os.listdir(directory)):
        name, ext = os.path.splitext(entry)
        if ext != ".py" or name.startswith("_") or name in _BENCH_HELPERS:
            continue
        with open(os.path.join(directory, entry), encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        found[name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _bench(args):
    import subprocess

    directory = os.path.abspath(args.dir)
    if not os.path.isdir(directory):
        raise _InputError(f"--dir {args.dir}: no such directory; expected the benchmarks/ "
                          f"folder of a tfmemopt clone (run from the clone, or pass --dir)")
    found = _benchmarks(directory)
    if args.list or args.name is None:
        width = max(map(len, found), default=0)
        for name, summary in found.items():
            print(f"{name:<{width}}  {summary}")
        return 0
    if args.name not in found:
        close = difflib.get_close_matches(args.name, found, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _InputError(f"no benchmark {args.name!r} in {args.dir}{hint}; allowed: "
                          f"{', '.join(found)}")
    command = [sys.executable, os.path.join(directory, f"{args.name}.py"), *args.args]
    return subprocess.run(command, check=False).returncode


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfmemopt",
        description="tfmemopt: keep, swap or recompute every tensor of a TensorFlow "
                    "training graph under a memory budget.",
        epilog="Exit codes: 0 success, 1 the job ran but failed, 2 bad usage or input.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="train a ResNet that runs out of memory under a cap without tfmemopt",
        description="Train a CIFAR-shaped ResNet under a capped CPU allocator: without "
                    "tfmemopt it runs out of memory, with tfmemopt it trains, and its losses "
                    "equal those of an uncapped run without tfmemopt, bit for bit. Exit "
                    "code 0 when all three hold.")
    demo.add_argument("--blocks", type=int, default=20, help="residual blocks (default 20)")
    demo.add_argument("--batch", type=int, default=128, help="batch size (default 128)")
    demo.add_argument("--cap-mb", type=int, default=256,
                      help="CPU allocator cap in MiB (default 256)")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    demo.add_argument("--json", action="store_true", help="also print the results as JSON")
    demo.set_defaults(run=_demo)
    analyze = sub.add_parser(
        "analyze", help="predict the memory of a saved training graph, without running it",
        description="Run the TfMemOpt pass (analysis only, nothing is executed) on a "
                    "SavedModel directory, or a binary GraphDef or MetaGraphDef .pb file, "
                    "and print its report. What is analyzed is what the fetches need: "
                    "--fetch, else the graph's train_op collection, else the outputs of "
                    "the SavedModel's signatures.",
        epilog="Exit codes: 0 success, 1 the pass fell back (see the report), 2 bad "
               "usage or input.")
    analyze.add_argument("path", metavar="PATH",
                         help="SavedModel directory, or GraphDef/MetaGraphDef .pb file")
    analyze.add_argument("--budget", metavar="SIZE",
                         help="per-device budget: bytes or a size like 2GiB or 512MB, or a "
                              "fraction of device memory like 0.8 (default 0.9)")
    analyze.add_argument("--fetch", metavar="NODE", nargs="+", action="extend",
                         help="node or tensor names the step runs (default: the train op "
                              "or the signature outputs)")
    analyze.add_argument("--assume-batch-size", metavar="N", type=int, default=0,
                         help="stands in for an unknown batch dimension")
    analyze.add_argument("--json", action="store_true",
                         help="also print the report as one JSON line, last")
    analyze.add_argument("--plot", metavar="OUT.png",
                         help="write the memory timeline chart as a PNG (needs matplotlib)")
    analyze.add_argument("--html", metavar="OUT.html",
                         help="write a standalone HTML report (needs matplotlib)")
    analyze.set_defaults(run=_analyze)
    maxbatch = sub.add_parser(
        "maxbatch", help="find the largest batch that trains under a capped allocator, "
                         "with and without tfmemopt",
        description="Binary-search the largest batch that trains under a capped CPU "
                    "allocator (TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB), "
                    "without and with tfmemopt, one subprocess per trial. SCRIPT defines "
                    "make_step(batch), returning (step, args) where step(*args) runs one "
                    "training step (e.g. a tf.function). A trial that fails with anything "
                    "but ResourceExhaustedError stops the search.",
        epilog="Exit codes: 0 the searches finished, 1 a trial failed with an error other "
               "than out-of-memory, 2 bad usage or input.")
    maxbatch.add_argument("script", metavar="SCRIPT",
                          help="a Python script that defines make_step(batch) "
                               "(SCRIPT:FUNCTION names another function)")
    maxbatch.add_argument("--lo", type=int, default=1, help="smallest batch (default 1)")
    maxbatch.add_argument("--hi", type=int, default=4096, help="largest batch (default 4096)")
    maxbatch.add_argument("--cap-mb", type=int, default=1024,
                          help="CPU allocator cap in MiB (default 1024)")
    maxbatch.add_argument("--budget", metavar="SIZE",
                          help="tfmemopt budget: bytes or a size like 2GiB or 512MB, or a "
                               "fraction of device memory like 0.8 (default 0.9)")
    maxbatch.add_argument("--steps", type=int, default=2,
                          help="training steps per trial (default 2)")
    maxbatch.add_argument("--timeout", type=float, default=900.0,
                          help="seconds per trial (default 900)")
    maxbatch.add_argument("--strategy", choices=("bisect", "grow"), default="bisect",
                          help="bisect: try --lo, --hi, then bisect; grow: try --lo, 2x, "
                               "4x, ... then bisect (default bisect)")
    maxbatch.add_argument("--no-baseline", action="store_true",
                          help="only search with tfmemopt")
    maxbatch.add_argument("--json", action="store_true",
                          help="also print both searches as one JSON line, last")
    maxbatch.set_defaults(run=_maxbatch)
    bench = sub.add_parser(
        "bench", help="run one of the benchmarks (tfmemopt bench NAME [ARGS...])",
        description="Run benchmarks/NAME.py of a tfmemopt clone in a fresh interpreter, "
                    "passing ARGS through (for example --json, --quick or --help). Without "
                    "NAME, or with --list, list the benchmarks. The benchmarks are not part "
                    "of the installed package: run this from a clone, or pass --dir.",
        epilog="Exit codes: the benchmark's own (0 success), 2 bad usage or input.")
    bench.add_argument("--dir", default="benchmarks",
                       help="folder with the benchmarks (default: ./benchmarks)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("name", metavar="NAME", nargs="?", help="the benchmark to run")
    bench.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER,
                       help="arguments for the benchmark")
    bench.set_defaults(run=_bench)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    for name in ("batch", "cap_mb", "steps", "lo", "hi", "timeout"):
        if getattr(args, name, 1) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive "
                         f"{'number' if name == 'timeout' else 'integer'}, got {getattr(args, name)}")
    if getattr(args, "assume_batch_size", 0) < 0:
        parser.error(f"--assume-batch-size must be >= 0, got {args.assume_batch_size}")
    try:
        return args.run(args)
    except _InputError as err:
        print(f"tfmemopt {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
