"""Key names: wrapper prefixes and optimizer entries (`keys`), tied pairs, and the name adapters
(`names`: torchtitan -> Hugging Face, with `titan/`'s tables and RoPE permutation)."""
