"""Using a trained model: `shardforge inference` (generate) and `shardforge evaluate` (eval loss).

A layer above the merge and training: the model comes from a merged directory, the run's
latest checkpoint merged on the fly by the merge itself, or the base model with a PEFT adapter
(`model.py`); evaluation is training's own data pipeline and loss (`evaluate.py`); generation
is transformers' `generate` with the config's chat template (`inference.py`). The options are
dataclasses in `request.py`, importable without torch (the commands' `--help`).
"""
