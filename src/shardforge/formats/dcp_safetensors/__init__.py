"""DCP's safetensors storage: ``HuggingFaceStorageWriter(save_distributed=True)`` has every rank
write ``shard-<S>-model-<K>-of-<N>.safetensors`` (S = rank + 1) holding its local chunks, each
chunk's place in the full tensor in the header's ``DCP_SHARDING_INFO``; with
``enable_consolidation=True`` (torchtitan's ``last_save_in_hf``) those go to ``sharded/`` and
torch's consolidator writes ``model-<K>-of-<N>.safetensors`` and ``model.safetensors.index.json``
beside it. `sharded` reads the per-rank files (any dtype: torch's consolidator refuses integer,
bool and uint8 tensors); the consolidated files are read as plain safetensors
(`formats.safetensors`), checked against the shards' headers."""
