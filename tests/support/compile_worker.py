"""Multi-process half of test_compile.py's parallel runs: under `torchrun --nproc_per_node 2`.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/compile_worker.py OUT SET...

One launch trains the same steps twice from the same seed (so the same weights and batches):
model.compile false into OUT/eager, then true into OUT/compiled. Rank 0 writes OUT/breaks.json:
the graph breaks Dynamo counted outside the named boundaries, their reasons, the start lines and
how many graphs were compiled of the layers' attention called apart.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_kappa.config import load_config
from megatron_kappa.model import compile as model_compile


def main(out, sets):
    from megatron_kappa.train.loop import run
    lines = []
    for switch in ("false", "true"):
        run(load_config("configs/tiny.yaml", sets + [f"run.dir={out}/{'compiled' if switch == 'true' else 'eager'}",
                                                     f"model.compile={switch}"]), log=lines.append)
    if os.environ.get("RANK", "0") == "0":
        from megatron.core.transformer.transformer_layer import TransformerLayer
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        Path(out, "breaks.json").write_text(json.dumps({
            "other": model_compile.graph_breaks()["other"], "reasons": model_compile.break_reasons(),
            "lines": [line for line in lines if line.startswith("compile:")],
            # graphs of the attention compiled apart (the EP overlap's schedule calls it apart)
            "attention_graphs": len(_debug_get_cache_entry_list(TransformerLayer._forward_attention))}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
