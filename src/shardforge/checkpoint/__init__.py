"""Reading sharded torch.distributed.checkpoint (DCP) checkpoints and writing Hugging Face files.

The merge is a pipeline of small stages, one module each:
locate (`layouts`) -> read metadata safely (`shardforge.io.unpickler`, `metadata`) -> map keys (`keys`)
-> check against the meta-device model (`architecture`) -> plan the output (`plan`)
-> stream chunks into place (`chunk_record`, `stream`) -> complete the directory
(`companions`) -> verify (`verify`), all inside a temporary sibling directory (`output`).
`hf_engine` is the alternative literal path through transformers. Nothing here imports the
training code.
"""
