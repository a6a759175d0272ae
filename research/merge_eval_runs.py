"""Merge ``kvquant eval`` results files made on the same windows into one, so ``kvquant eval OUT --compare A,B`` can
pair configs of different runs. Refuses files whose reference rows differ (other windows, tokens or model).

    python research/merge_eval_runs.py OUT.json RUN1/results.json RUN2/results.json ...
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out, files = argv[0], argv[1:]
    with open(files[0]) as f:
        base = json.load(f)
    ref = next(r for r in base["results"] if r["config"] == "reference")
    names = base["meta"]["recipe"]["configs"]
    for path in files[1:]:
        with open(path) as f:
            run = json.load(f)
        other = next(r for r in run["results"] if r["config"] == "reference")
        if other["windows"] != ref["windows"]:
            print(f"{path}: its reference rows differ from {files[0]}'s: not the same windows", file=sys.stderr)
            return 2
        for row in run["results"]:
            if row["config"] != "reference" and row["config"] not in names:
                base["results"].append(row)
                names.append(row["config"])
    with open(out, "x") as f:  # never overwrites
        json.dump(base, f)
    print(f"wrote {out}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
