"""Plan digests, to prove that a planner refactor leaves every plan as it was.

For the stress specs 0..N-1 (tests/generated_graphs.py, the pass alone) and the seed
CNN and a 4-block CIFAR ResNet at three budgets each: a hash of the output graph,
the recomputed ops, the swapped tensors, the predicted peak, the search kind, the
number of simulations and the predicted added seconds. Run before and after a change
and compare the files (cmp): they must be equal.

    python benchmarks/plan_digest.py 200 OUT.json
"""
import hashlib, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests")); sys.path.insert(0, HERE)
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
import generated_graphs as gg
import tfmemopt
from tfmemopt.analysis import metagraph_of

def digest(graph, report):
    key = sorted((n.name, n.op, tuple(n.input)) for n in graph.node)
    d = report.to_dict() if report else {}
    rec = d.get("recompute", {}); sw = d.get("swap", {})
    return {"graph": hashlib.sha1(repr(key).encode()).hexdigest()[:16],
            "recomputed": rec.get("nodes"), "swapped": sw.get("tensors"),
            "after": report.predicted_peak_bytes.get("after") if report else None,
            "status": d.get("status"), "search": rec.get("search"),
            "simulations": rec.get("simulations"), "added": rec.get("added_seconds")}

out = {}
n = int(sys.argv[1])
for i in range(n):
    spec = gg.random_spec(i)
    try:
        probe = gg.Model(spec)
        mg = metagraph_of(probe.step_function().get_concrete_function())
        peak = tfmemopt.analyze_metagraph(mg, mode="ANALYZE_ONLY")
        pb = max(peak.predicted_peak_bytes["before"].values() or [0])
        fields = gg.config_fields(spec, pb)
        g, r = gg._optimize(mg, fields, alone=True)
        out[f"stress{i}"] = digest(g, r)
    except Exception as e:
        out[f"stress{i}"] = {"error": type(e).__name__}
import models
from conftest import optimize, peak_before
for name, make, fracs in [("seed_cnn", lambda: models.seed_cnn(256), (0.7, 0.4, 0.2)),
                          ("resnet4", lambda: models.cifar_resnet(blocks=4, batch=32), (0.9, 0.55, 0.25))]:
    step, (x, y) = make()
    before = peak_before(step, x, y)
    for f in fracs:
        g, r = optimize(step, x, y, budget=int(f * before))
        out[f"{name}@{f}"] = digest(g, r)
json.dump(out, open(sys.argv[2], "w"), indent=0, sort_keys=True)
print("done", len(out))
