"""Where trainers put their checkpoints: one `Layout` row per trainer (`layout`) and the catalog
of one run folder, scanned once per command (`catalog`); used by the merge, `inspect` and
training's resume."""
