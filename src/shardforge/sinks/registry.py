"""The outputs `--format` chooses: one `Sink` per value. (A LoRA checkpoint's adapter directory
and `--engine transformers` are sinks chosen by the input and the engine:
`sinks.hf_dir.AdapterDirectorySink`, `sinks.engine.TransformersSink`.)"""

from __future__ import annotations

from shardforge.sinks.base import Sink
from shardforge.sinks.hf_dir import HfDirectorySink, SafetensorsFileSink
from shardforge.sinks.torch_file import TorchFileSink

SINKS: dict[str, Sink] = {
    s.name: s for s in (HfDirectorySink(), SafetensorsFileSink(), TorchFileSink())
}
