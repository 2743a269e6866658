"""Where every example writes what it measured: ``--loss_log_file PATH`` -> ``PATH.rank<R>.json``
(one file a rank, so no rank waits on another to report). Not part of the examples' API:
the scripts' only extra argument, as the bf16 example's own ``--loss_log_file``."""

import json

import torch.distributed as dist


def write(path, record):
    if not path:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{path}.rank{rank}.json", "w") as f:
        json.dump(record, f)
