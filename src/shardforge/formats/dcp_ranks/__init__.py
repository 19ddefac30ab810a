"""Collective-free DCP: ``torch.distributed.checkpoint.save(..., use_collectives=False)`` has
every rank plan and write on its own: ``__R_N.distcp`` data files as usual, but one
``__R.metadata`` per rank describing only that rank's chunks, and no global ``.metadata``.
Every rank's metadata is read through the DCP allow-list profile and cross-checked
(`rank_metadata`); the records and sources are DCP's (`formats.dcp`)."""
