"""``python -m engine.config CONFIG --world-size N``: print the resolved config as JSON (stdout)
and the DP x TP x PP mesh (stderr).

Exits 2 with one line ``config error: ...`` on stderr when the config is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from engine.config.loader import load_config
from engine.errors import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.config",
                                     description="Validate a DeepSpeed-format JSON config and print it resolved.")
    parser.add_argument("config", help="path to the JSON config")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks the run will launch")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, world_size=args.world_size)
    except ConfigError as e:
        print(f"config error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    # stdout is exactly the resolved config, loadable again; the mesh goes to stderr.
    print(json.dumps(cfg.to_dict(), indent=2))
    print(f"topology: dp={cfg.dp} tp={cfg.tp} pp={cfg.pp} world_size={cfg.world_size}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
