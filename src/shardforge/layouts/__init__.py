"""Where trainers put their checkpoints: one table of step layouts (`steps`), used by the merge,
`inspect` and training's resume."""
