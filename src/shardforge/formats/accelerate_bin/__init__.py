"""accelerate's per-rank `.bin` files: ``save_fsdp_model(..., use_dcp=False)`` with FSDP2's
SHARDED_STATE_DICT writes ``pytorch_model_fsdp_0_rank<R>.bin`` on every rank, a ``torch.save``
of the rank's DTensor state dict (the whole model, or the adapter with ``adapter_only=True``).
The files are read as per-rank DTensor files (`formats.rankfiles`): the same allow-list
profile, planner, sources and reference reader, under accelerate's names."""
