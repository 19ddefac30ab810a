"""Where merged weights go: a Hugging Face directory (`hf_dir`), one torch file (`torch_file`),
or the transformers engine (`engine`: dcp.load + save_pretrained)."""
