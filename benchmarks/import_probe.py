"""Where a command's start-up goes on this host: `python -X importtime` of what `prepare` and `train`
import before their first phase, summed per top-level package, and CUDA's initialisation.

    python benchmarks/import_probe.py [--out FILE]
"""

import argparse
import json
import subprocess
import sys
import time

CLI = "import flashdraft.cli; from flashdraft.hf_startup import prepare_transformers; prepare_transformers()"
STATEMENTS = {
    "torch": "import torch",
    # as the CLI's main runs them: prepare_transformers() before the command's own imports
    "prepare": f"{CLI}; from flashdraft.data.prepare import prepare",
    "train": f"{CLI}; from flashdraft.train.job import run_job; from flashdraft.train.trainer import train",
    "transformers_model": "import transformers; from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_config",
}


def profile(statement: str) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - started
    own: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line[13:]:
            continue
        try:
            self_us, cumulative_us, name = (part.strip() for part in line[12:].split("|"))
            self_us, cumulative_us = int(self_us), int(cumulative_us)
        except ValueError:
            continue
        package = name.strip().split(".")[0]
        own[package] = own.get(package, 0.0) + self_us / 1e6
        top.append((cumulative_us / 1e6, name.strip()))
    by_package = dict(sorted(((k, round(v, 3)) for k, v in own.items()), key=lambda kv: -kv[1])[:15])
    return {
        "wall_s": round(wall, 2),
        "self_seconds_by_package": by_package,
        "largest_cumulative": [[round(s, 3), n] for s, n in sorted(top, reverse=True)[:25]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict = {name: profile(statement) for name, statement in STATEMENTS.items()}
    cuda = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch,time; t=time.perf_counter(); torch.zeros(1, device='cuda'); "
            "print(round(time.perf_counter()-t, 3))",
        ],
        capture_output=True,
        text=True,
    )
    result["cuda_init_s"] = cuda.stdout.strip() or cuda.stderr[-300:]
    for name in STATEMENTS:
        r = result[name]
        print(
            f"{name:20s} wall {r['wall_s']:6.2f} s  top: "
            + ", ".join(f"{k} {v:.2f}" for k, v in list(r["self_seconds_by_package"].items())[:6])
        )
    print("cuda init", result["cuda_init_s"])
    if args.out:
        from flashdraft.bench.provenance import provenance  # imported here: after the timed children

        record = provenance("import-probe", None)
        record.update(benchmark="benchmarks/import_probe.py", command=" ".join(["python3", *sys.argv]))
        with open(args.out, "w") as f:
            json.dump({**record, **result}, f, indent=1)


if __name__ == "__main__":
    main()
