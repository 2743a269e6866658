"""Regenerate tests/assets/ds_style_train_deepspeed_w{2,4}.json: real DeepSpeed running the
unchanged tests/assets/ds_style_train.py under torchrun (CPU, gloo), plus, per ZeRO stage,
the fp32 weights DeepSpeed's own zero_to_fp32 reads from the checkpoint the script saved
and the weights of its save_16bit_model file.

    OMP_NUM_THREADS=1 python tests/assets/make_ds_style_golden.py /tmp/ds_golden
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def fp32_weights(ckpt: str, stage: str) -> dict:
    """DeepSpeed's fp32 weights of a checkpoint: its zero_to_fp32 for ZeRO 1-3; ZeRO-0 (which
    zero_to_fp32 does not read) keeps the fp32 module in mp_rank_00_model_states.pt."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if stage == "0":
        sd = torch.load(os.path.join(ckpt, "mid", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    else:
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="mid")
    return {k: v.float().flatten().tolist() for k, v in sd.items()}


def main(work: str) -> None:
    import torch

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    for world, port in ((2, 29651), (4, 29652)):
        wd = os.path.join(work, f"w{world}")
        os.makedirs(wd, exist_ok=True)
        out = os.path.join(wd, "result.json")
        subprocess.run(["torchrun", "--nproc_per_node", str(world), "--master_port", str(port),
                        os.path.join(HERE, "ds_style_train.py"), "--deepspeed", "--zero_stages", "0,1,2,3",
                        "--workdir", wd, "--out", out], check=True, env=env, cwd=wd)
        res = json.load(open(out))
        res["fp32_weights"] = {s: fp32_weights(os.path.join(wd, f"ckpt_zero{s}"), s) for s in res["stages"]}
        res["weights16"] = {s: {k: v.float().flatten().tolist() for k, v in
                                torch.load(os.path.join(wd, f"model16_zero{s}.bin")).items()} for s in res["stages"]}
        with open(os.path.join(HERE, f"ds_style_train_deepspeed_w{world}.json"), "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
