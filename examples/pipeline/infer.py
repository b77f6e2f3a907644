"""Score one shard with the best model of the sweep."""

import argparse
import json
import math
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--shard", type=int, required=True)
parser.add_argument("--runs", type=Path, required=True)
args = parser.parse_args()

models = [json.loads(p.read_text()) for p in sorted((args.runs / "trials").glob("*/model.json"))]
best = max(models, key=lambda m: m["val_acc"])
w = best["w"]
rows = json.loads((args.runs / "shards" / f"{args.shard}.json").read_text())
preds = [1 / (1 + math.exp(-max(-30.0, min(30.0, w[0] * x + w[1] * y + w[2])))) for x, y, _ in rows]
out = args.runs / "predictions"
out.mkdir(parents=True, exist_ok=True)
(out / f"{args.shard}.json").write_text(json.dumps(preds))
accuracy = sum((p > 0.5) == bool(r[2]) for p, r in zip(preds, rows, strict=True)) / len(rows)
print(
    f"shard {args.shard}: best trial val_acc={best['val_acc']:.4f}, shard accuracy={accuracy:.4f}"
)
