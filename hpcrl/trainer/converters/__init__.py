"""Model converters: named changes to the torch trainer's model, applied when it is built (`train.converters`).

A converter may change the model in place (add adapter layers, swap in quantized linears, freeze modules),
and so decides which parameters train: the optimizer holds only those with `requires_grad`. It also says what
a weight push sends (the tensors a step can change, in the form the engines apply) and what an export writes
(the whole model), which the trainer keeps apart (hpcrl/trainer/protocol.py). See `base.ModelConverter`.

A new converter is one module with a `ModelConverter` subclass and one line in `CONVERTERS`, plus the
`train.*` keys it reads. This module imports nothing, so a config is checked without torch.
"""

from __future__ import annotations

# name -> "module:Class" of a `base.ModelConverter` subclass, imported when a run asks for it
# (`base.build_converters`).
CONVERTERS: dict[str, str] = {
    "freeze": "hpcrl.trainer.converters.freeze:FreezeModules",
    "lora": "hpcrl.trainer.converters.lora:LoRA",
}
