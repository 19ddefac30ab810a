"""FSDP2 training from the YAML config: launch, model, data, loop, checkpoints.

The training package never imports the merge (`shardforge.merge`; an import-linter contract).
"""
