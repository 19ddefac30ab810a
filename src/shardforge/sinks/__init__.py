"""Outputs: one `Sink` class per kind of output (`sinks.base`), used by the merge and by
training's full-model save; the output plan (`plan`), the weights writer (`safetensors_files`),
the companions of an HF directory, verification of what was written (`verify`)."""
