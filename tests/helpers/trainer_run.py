"""examples/trainer_hf.py as it is, counting each decoder layer's attention calls in training:
run by tests/distributed/test_integrations_trainer.py under torchrun or `accelerate launch` with the
example's arguments plus `--calls PATH`, where rank 0 writes {trainer: calls per layer and
micro-batch in training} as JSON. A layer runs its attention once per micro-batch in
forward, and once more per recompute in backward."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer_hf.py"


def main():
    i = sys.argv.index("--calls")
    calls_path = sys.argv.pop(i + 1)
    sys.argv.pop(i)
    spec = importlib.util.spec_from_file_location("trainer_hf_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from transformers import TrainerCallback

    build, per_step = example.build_trainer, {}

    class Count(TrainerCallback):
        def __init__(self, name, calls):
            self.name, self.calls = name, calls

        def on_train_begin(self, args, state, control, **kwargs):
            self.first_step, self.calls[:] = state.global_step, [0] * len(self.calls)

        def on_train_end(self, args, state, control, **kwargs):
            micro_batches = (state.global_step - self.first_step) * args.gradient_accumulation_steps
            per_step[self.name] = [n / micro_batches for n in self.calls]

    def counting_build(args, name, distributed):
        trainer = build(args, name, distributed)
        layers = trainer.model.model.layers
        calls = [0] * len(layers)
        for j, layer in enumerate(layers):
            layer.self_attn.register_forward_hook(
                lambda *a, j=j: calls.__setitem__(j, calls[j] + 1)
            )
        trainer.add_callback(Count(name, calls))
        return trainer

    example.build_trainer = counting_build  # what example.train builds its trainer with
    example.main()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(calls_path).write_text(json.dumps(per_step))


if __name__ == "__main__":
    main()
