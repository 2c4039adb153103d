"""Core entry to the checkpoint fabricator, so the command line (`rimuru fabricate`) need not reach into models."""

from rimuru.models.fabricate import fabricate

__all__ = ["fabricate"]
