"""DCP checkpoints: `.metadata` (allow-list parsed, paths and tiling checked), chunk records
located inside `.distcp` files, the chunk reader, and torch's reader fed the safe metadata."""
