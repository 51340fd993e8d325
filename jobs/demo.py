"""Train the demo model on one machine and print samples.

    python jobs/demo.py [--config conf/demo.toml] [--set section.key=value ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm import config  # noqa: E402
from rnnlm.core.generate import generate  # noqa: E402
from rnnlm.core.single import train  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="conf/demo.toml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default=None, help="checkpoint directory to write")
    ap.add_argument("--prime", default="The light")
    a = ap.parse_args(argv)
    try:
        cfg = config.load(a.config, a.set)
        m = train(cfg, out=a.out)
    except (config.ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for seed, temp in ((1, 0.7), (2, 1.0)):
        text = generate(m["model"], m["params"], m["vocab"], prime=a.prime, length=200,
                        temperature=temp, seed=seed)
        print(f"\n--- sample (temperature {temp}, seed {seed}) ---\n{m['vocab'].join(a.prime, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
