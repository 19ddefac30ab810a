"""Which config values name object storage, and the check for keys read as local paths."""

from __future__ import annotations


def names_object_storage(value: object) -> bool:
    """Whether `value` names object storage: ``s3://...``, or that URI folded by a Path
    (``s3:/...``), which read as a local path would become a folder named ``s3:``."""
    return value is not None and str(value).startswith("s3:/")


def local_path(value: str | None, expected: str) -> str | None:
    """`value`, unless it names object storage (read as a local path, ``s3://`` would become a
    folder named ``s3:``)."""
    if names_object_storage(value):
        raise ValueError(
            f"{value}: object storage is supported for output_dir and the merge's "
            f"--checkpoint/--output_path; give {expected} (copy it down first)"
        )
    return value
