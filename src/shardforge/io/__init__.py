"""The only code that touches the bytes of checkpoint files: zip records (`zip_record`),
regular-file opens (`files`), the allow-list unpickler, dtype tables."""
